"""Hugging Face models through the workload contract: default loss, layers, TP plan, and
training runs under every strategy, from configs (nothing is downloaded)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli, serving
from runs import losses
from safetensors.torch import load_file
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    GPT2Config,
    GPT2LMHeadModel,
)
from transformers.modeling_outputs import CausalLMOutput
from user_workloads import hf_models

import gpuflow
from gpuflow.cli import main
from gpuflow.errors import UserError
from gpuflow.planner.workload_profile import tensor_parallel_plan
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.workload import accuracy, cross_entropy, model_logits

TRAIN = ["train", "--schedule", "constant", "--warmup-steps", "0", "--log-every", "1",
         "--eval-every", "0", "--no-progress"]


def test_default_loss_reads_model_outputs_tuples_and_sequence_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.bfloat16)
    target = torch.randint(0, 7, (2, 5))
    target[0, :2] = -100
    kept = target != -100
    expected = torch.nn.functional.cross_entropy(logits.float()[kept], target[kept])
    for outputs in (logits, (logits, torch.zeros(1)), CausalLMOutput(logits=logits),
                    {"logits": logits}):
        loss = cross_entropy(outputs, target)
        assert loss.dtype == torch.float32
        assert torch.allclose(loss, expected)
        assert torch.equal(model_logits(outputs), logits)
    hits = (logits.argmax(-1) == target)[kept].float().mean()
    assert torch.equal(accuracy(CausalLMOutput(logits=logits), target), hits)
    # A model that computed its own loss from labels: that loss is the loss.
    own = torch.tensor(1.25, dtype=torch.bfloat16)
    assert cross_entropy(CausalLMOutput(loss=own, logits=logits), target).item() == 1.25
    with pytest.raises(UserError, match="without any"):
        cross_entropy({"hidden": logits}, target)


def test_layers_and_the_models_own_tensor_parallel_plan_are_found() -> None:
    llama = hf_models.llama()
    assert [type(b).__name__ for b in llama.blocks()] == ["LlamaDecoderLayer"] * 4
    plan = llama.parallel_plan(2)
    assert set(plan) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert isinstance(plan["self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["mlp.down_proj"], RowwiseParallel)
    with pytest.raises(UserError, match="4 num attention heads, which --tp 3"):
        llama.parallel_plan(3)
    # The planner offers tensor-parallel layouts on the same plan.
    assert set(tensor_parallel_plan(llama)) == set(plan)
    vit = hf_models.vit()
    assert [type(b).__name__ for b in vit.blocks()] == ["ViTLayer"] * 2  # not ViTEmbeddings
    gpt2 = gpuflow.Workload(name="gpt2", model=GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32,
                                                                          n_head=2)),
                            train_dataset=hf_models.DictInputs(hf_models._pydoc_windows()[1]))
    assert len(gpt2.blocks()) == 2
    with pytest.raises(UserError, match="GPT2LMHeadModel ships no tensor-parallel plan"):
        gpt2.parallel_plan(2)


def test_a_plan_style_gpuflow_cannot_apply_names_the_layer() -> None:
    llama = hf_models.llama()
    llama.model.config.base_model_tp_plan = {"layers.*.mlp.gate_up_proj": "packed_colwise"}
    with pytest.raises(UserError, match="layers.0.mlp.gate_up_proj as 'packed_colwise'"):
        llama.parallel_plan(2)


def train(run_dir: Path, workload: str, *args: str) -> list[float]:
    """`gpuflow train`: launched as a user would for several ranks; for one process, in
    this one (the CLI's own code, without a second import of torch and transformers)."""
    argv = [*TRAIN, "--workload", f"user_workloads.hf_models:{workload}",
            "--run-dir", str(run_dir), *args]
    if "--nproc" in args:
        result = run_cli(*argv)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    else:
        assert main(argv) == 0
    return losses(run_dir)


def export_hf(run_dir: Path, out: Path) -> None:
    """`gpuflow export --format hf`, in this process (the CLI's own code, without a second
    import of torch and transformers)."""
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(out)]) == 0


def served(source: Path, body: dict) -> dict:
    """One request to a server of ``source``, as a client sends it."""
    async def scenario() -> dict:
        app = create_app(ServeSettings(str(source), device="cpu", max_batch_size=4,
                                       engine_process=False))
        async with serving(app) as client:
            reply = await client.post("/v1/predict", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()

    return asyncio.run(scenario())


def trained_model(run_dir: Path, workload: gpuflow.Workload) -> torch.nn.Module:
    """The factory's model with the run's newest weights, as gpuflow itself loads them."""
    out = run_dir / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    workload.model.load_state_dict(load_file(out))
    return workload.model.eval()


@pytest.mark.slow
def test_gpt2_trains_with_ddp_and_fsdp_as_in_one_process_and_exports(tmp_path: Path) -> None:
    single = train(tmp_path / "single", "gpt2", "--batch-size", "16", "--max-steps", "6",
                   "--no-checkpoints")
    assert single[-1] < single[0]
    ddp = train(tmp_path / "ddp", "gpt2", "--nproc", "2", "--strategy", "ddp",
                "--batch-size", "8", "--max-steps", "6", "--no-checkpoints")
    # FSDP wraps the GPT2Blocks found from _no_split_modules; checkpointing recomputes them.
    fsdp = train(tmp_path / "fsdp", "gpt2", "--nproc", "2", "--strategy", "fsdp",
                 "--batch-size", "8", "--max-steps", "6", "--activation-checkpointing")
    # Measured here: max |difference| about 2e-7 (fp32 reduction order).
    assert ddp == pytest.approx(single, abs=1e-5)
    assert fsdp == pytest.approx(single, abs=1e-5)
    # The sharded checkpoint, exported in the model's own format, opens in transformers.
    export_hf(tmp_path / "fsdp", tmp_path / "hf")
    reopened = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reopened).__name__ == "GPT2LMHeadModel"
    tokens = torch.randint(0, 256, (2, hf_models.SEQ))
    with torch.no_grad():
        expected = trained_model(tmp_path / "fsdp", hf_models.gpt2())(tokens).logits
        assert torch.equal(reopened(tokens).logits, expected)
    # Served from its export, the model's sequence logits come back by name.
    reply = served(tmp_path / "fsdp" / "model.safetensors", {"inputs": tokens.tolist()})
    logits = torch.tensor([p["outputs"]["logits"] for p in reply["predictions"]])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_llama_splits_by_its_own_plan_and_by_manual_pipeline_stages(tmp_path: Path) -> None:
    single = train(tmp_path / "single", "llama", "--batch-size", "8", "--max-steps", "6")
    tp = train(tmp_path / "tp", "llama", "--nproc", "2", "--strategy", "tp",
               "--batch-size", "8", "--max-steps", "6")
    pp = train(tmp_path / "pp", "llama", "--nproc", "2", "--strategy", "pp",
               "--pp-split", "manual", "--batch-size", "8", "--max-steps", "6")
    # Measured here: max |difference| about 1e-7.
    assert tp == pytest.approx(single, abs=1e-5)
    assert pp == pytest.approx(single, abs=1e-5)
    summary = json.loads((tmp_path / "pp" / "summary.json").read_text())
    assert summary["config"]["pp_split"] == "manual" and summary["final_metrics"]["val_loss"] > 0
    # Its dict inputs are served as named fields.
    inputs, _ = hf_models.llama().val_dataset[0]
    with torch.no_grad():
        model = trained_model(tmp_path / "pp", hf_models.llama())
        expected = model(**{k: v[None] for k, v in inputs.items()}).logits
    reply = served(tmp_path / "pp" / "model.safetensors",
                   {"inputs": {k: [v.tolist()] for k, v in inputs.items()}})
    logits = torch.tensor(reply["predictions"][0]["outputs"]["logits"])
    torch.testing.assert_close(logits, expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_vit_classifier_learns_the_digits(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(run_dir, "vit", "--batch-size", "32", "--max-steps", "200", "--lr", "3e-3")
    final = json.loads((run_dir / "summary.json").read_text())["final_metrics"]
    assert final["val_accuracy"] > 0.8  # chance is 0.1; measured here: 0.84-0.86
    export_hf(run_dir, tmp_path / "hf")
    reopened = AutoModelForImageClassification.from_pretrained(tmp_path / "hf").eval()
    images = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        expected = trained_model(run_dir, hf_models.vit())(images).logits
        assert torch.equal(reopened(images).logits, expected)
    # Served, its class logits come back as the top labels.
    reply = served(run_dir, {"inputs": images.tolist(), "top_k": 10})
    for prediction, probs in zip(reply["predictions"], expected.softmax(-1), strict=True):
        assert prediction["index"] == int(probs.argmax())
        assert prediction["probability"] == pytest.approx(float(probs.max()), abs=1e-5)
