import json
from pathlib import Path

import pytest
import torch
from generation import greedy_reference
from safetensors import safe_open
from safetensors.torch import load_file
from user_workloads import TinyMLP, mlp

from gpuflow import TrainConfig, train
from gpuflow.byte_vocab import END_OF_DOCUMENT
from gpuflow.cli import main


def test_export_writes_the_final_weights_with_the_run_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = train(mlp(), TrainConfig(max_steps=5, batch_size=32, progress=False,
                                      run_dir=str(run_dir), workload="user_workloads:mlp"))
    out = tmp_path / "export" / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    weights = load_file(out)
    fresh = TinyMLP()
    fresh.load_state_dict(weights)
    for name, tensor in result.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    with safe_open(out, "pt") as handle:
        metadata = handle.metadata()
    assert metadata["step"] == "5" and metadata["workload"] == "user_workloads:mlp"
    assert json.loads(metadata["config"])["max_steps"] == 5


def test_export_of_a_dir_without_checkpoints_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "not a gpuflow run dir" in capsys.readouterr().err


def test_textlm_exports_as_gpt2_that_transformers_opens_with_equal_outputs(
    tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpuflow.workloads import textlm

    size = "layers=2,dim=32,heads=4,seq=64"
    run_dir = tmp_path / "run"
    result = train(textlm.build(model_size=size),
                   TrainConfig(max_steps=20, batch_size=16, progress=False, eval_every=0,
                               run_dir=str(run_dir), workload="textlm", model_size=size))
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(out)]) == 0
    gpt2 = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(gpt2).__name__ == "GPT2LMHeadModel"
    assert json.loads((out / "gpuflow_run.json").read_text())["step"] == 20
    prompt = "def main():\n    print('héllo')"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == list(prompt.encode("utf-8"))  # token i is byte i
    ours = result.model.eval()
    with torch.no_grad():
        # Measured here: identical logits. The bound allows fp32 rounding where another
        # CPU's kernels sum in another order; docs/checkpoints.md states the same 1e-6.
        worst = (gpt2(ids).logits - ours(ids)).abs().max().item()
        print(f"max |logit difference| {worst:.1e}")
        assert worst <= 1e-6
        hf_greedy = gpt2.generate(ids, max_new_tokens=24, do_sample=False)[0].tolist()
    assert hf_greedy == ids[0].tolist() + greedy_reference(ours, prompt.encode(), 24)
    assert tokenizer.decode(hf_greedy[:ids.shape[1]]) == prompt


def test_a_model_without_a_hugging_face_form_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    train(mlp(), TrainConfig(max_steps=2, batch_size=32, progress=False,
                             run_dir=str(run_dir), workload="user_workloads:mlp"))
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(out)]) == 2
    assert "has no Hugging Face form" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".hf.tmp*"))


@pytest.mark.parametrize("model", ["textlm", "hf-gpt2"])
def test_a_byte_model_export_carries_the_byte_tokenizer(tmp_path: Path, model: str) -> None:
    """Whether its writer saved the tokenizer (textlm) or only the model (a Hugging Face
    model over bytes), the export is a whole Hub-style directory: ``AutoTokenizer`` maps
    any text to its UTF-8 bytes and back."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from gpuflow import Workload
    from gpuflow.export import write_hf_export
    from gpuflow.workloads import textlm

    workload = textlm.build(data="synthetic", model_size="layers=1,dim=32,heads=2,seq=32") \
        if model == "textlm" else Workload(
            name=model, train_dataset=[], model=GPT2LMHeadModel(GPT2Config(
                vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2)))
    out = tmp_path / "hf"
    write_hf_export(workload, {"workload": model}, 0, out)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    for text in ("héllo 🚀", "東京の天気 — naïve 👍🏽\n\tx"):
        assert tokenizer.encode(text) == list(text.encode("utf-8"))
        assert tokenizer.decode(list(text.encode("utf-8"))) == text
        ended = [*text.encode("utf-8"), END_OF_DOCUMENT]
        assert tokenizer.decode(ended, skip_special_tokens=True) == text
    # Byte 0xFF ends a document: the token tools reading the format stop and pad with.
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.pad_token_id \
        == END_OF_DOCUMENT
    if model == "textlm":
        from transformers import AutoConfig, GenerationConfig

        assert AutoConfig.from_pretrained(out).eos_token_id == END_OF_DOCUMENT
        assert GenerationConfig.from_pretrained(out).eos_token_id == END_OF_DOCUMENT
