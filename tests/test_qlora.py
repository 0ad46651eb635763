"""QLoRA (--lora-rank with --quantize-base nf4): the base's linear layers are held as NF4 and
the loss still falls; only the adapters sit in the optimizer and the checkpoint; a resumed run
is bitwise the uninterrupted one; 2 FSDP ranks shard the NF4 base and follow one process; PEFT
opens the exported adapter with the trained logits on the base the run trained against, the
merged export gives them too; bad input is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hub_models import one_thread
from runs import losses, newest_weights
from test_lora import (
    ADAPTER_ATOL,
    MERGED_ATOL,
    RANKS_ATOL,
    SEQ,
    STEPS,
    adapters,
    join_two_ranks,
    setup,
)

from gpuflow import Trainer, nf4, train
from gpuflow.cli import main
from gpuflow.errors import EXIT_USER_ERROR, UserError
from gpuflow.export import export_model
from gpuflow.lora import LoraSpec, wrap
from gpuflow.parallel.env import free_port

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")]

QLORA = {"quantize_base": "nf4", "max_steps": 2 * STEPS}


@pytest.fixture(scope="module")
def qlora_run(hub_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A trained QLoRA run of the tiny Llama."""
    run_dir = tmp_path_factory.mktemp("qlora") / "run"
    with one_thread():
        return train(*setup(hub_models["llama"], run_dir, **QLORA))


def test_an_nf4_base_trains_its_adapters_only(qlora_run: Any) -> None:
    model = qlora_run.model
    frozen = {name: type(param).__name__ for name, param in model.named_parameters()
              if not param.requires_grad}
    assert frozen["base_model.model.model.layers.0.mlp.down_proj.base_layer.weight"] == (
        "NF4Tensor")
    assert frozen["base_model.model.lm_head.weight"] == "Parameter"  # left as saved
    trained = adapters(model)
    assert set(newest_weights(qlora_run.run_dir)) == set(trained)
    steps = losses(qlora_run.run_dir)
    assert steps[-1] < 0.8 * steps[0]


@pytest.mark.slow
def test_a_resumed_qlora_run_is_bitwise_the_uninterrupted_one(
        hub_models: Any, qlora_run: Any, tmp_path: Path) -> None:
    directory = hub_models["llama"]
    first = Trainer(*setup(directory, tmp_path / "split", **QLORA))
    optimized = {id(p) for group in first.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in adapters(first.model).values()}
    first.run_steps(1)
    first.save_checkpoint()
    first.close()
    resumed = train(*setup(directory, tmp_path / "split", resume=True, **QLORA))
    assert losses(tmp_path / "split")[-1] == losses(qlora_run.run_dir)[-1]
    for (name, a), b in zip(adapters(qlora_run.model).items(),
                            adapters(resumed.model).values(), strict=True):
        assert torch.equal(a, b), name


def _fsdp_ranks(rank: int, port: int, directory: str, run_dir: str) -> None:
    join_two_ranks(rank, port)
    from gpuflow.parallel.env import shutdown

    try:
        train(*setup(Path(directory), Path(run_dir), batch_size=2, strategy="fsdp", nproc=2,
                     **QLORA))
    finally:
        shutdown()


@pytest.mark.slow
def test_two_fsdp_ranks_shard_the_nf4_base_and_follow_one_process(
        hub_models: Any, qlora_run: Any, tmp_path: Path) -> None:
    mp.spawn(_fsdp_ranks, args=(free_port(), str(hub_models["llama"]), str(tmp_path / "run")),
             nprocs=2)
    assert losses(tmp_path / "run") == pytest.approx(losses(qlora_run.run_dir), abs=RANKS_ATOL)


def test_fsdp_refuses_nf4_codes_that_do_not_split_over_the_ranks() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 3))  # 3 rows: not 2 equal shards
    nf4.quantize([("0", model[0])])
    with pytest.raises(UserError, match="0.weight has 3 rows, 3 blocks of codes, 3 blocks "
                                        "of scales, which FSDP2 cannot split evenly over 2"):
        nf4.check_shards(model, 2)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_exports_give_the_trained_logits_on_the_nf4_rounded_base(
        hub_models: Any, qlora_run: Any, tmp_path: Path) -> None:
    """PEFT's adapter on the base rounded through NF4 (what the run trained against) is the
    trained model; on the unrounded base the logits move by the base's own NF4 rounding
    (docs/workloads/finetune.md)."""
    import peft
    import transformers

    directory = hub_models["llama"]
    ids = torch.randint(0, 4096, (2, SEQ), generator=torch.Generator().manual_seed(1))
    trained = _logits(qlora_run.model, ids)
    export_model(qlora_run.run_dir, tmp_path / "adapter", "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    nf4.quantize((name, module) for name, module in base.named_modules()
                 if isinstance(module, torch.nn.Linear) and name != "lm_head")
    nf4.dequantize(base)
    opened = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert (_logits(opened, ids) - trained).abs().max().item() <= ADAPTER_ATOL

    export_model(qlora_run.run_dir, tmp_path / "merged", "hf", merge=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert {type(p) for p in merged.parameters()} == {torch.nn.Parameter}
    assert (_logits(merged, ids) - trained).abs().max().item() <= MERGED_ATOL


def test_quantize_base_wants_linear_layers() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8))
    with pytest.raises(UserError, match="Sequential has no linear layer besides its output "
                                        "layer to hold in NF4"):
        wrap(model, LoraSpec(2, targets="0", quantize="nf4"))


@pytest.mark.parametrize(("flags", "message"), [
    (["--quantize-base", "nf4"], "--quantize-base nf4 holds the frozen base of a LoRA run"),
    (["--lora-rank", "4", "--quantize-base", "nf4", "--strategy", "ddp", "--nproc", "2"],
     "--quantize-base nf4 trains under --strategy single and fsdp (this run: --strategy ddp)"),
])
def test_bad_qlora_flags_exit_2(hub_models: Any, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str], flags: list[str],
                                message: str) -> None:
    code = main(["train", "--workload", f"hf:{hub_models['llama']}", "--data", "synthetic",
                 "--seq-len", str(SEQ), "--max-steps", "1", "--no-progress",
                 "--run-dir", str(tmp_path / "run"), *flags])
    assert code == EXIT_USER_ERROR
    assert message in capsys.readouterr().err
