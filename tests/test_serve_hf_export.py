"""`gpuflow serve` on a `gpuflow export --format hf` directory: the run's workload rebuilt from
its gpuflow_run.json, the weights opened by transformers, and over HTTP the same greedy
completions and predictions as the run dir, for textlm (a GPT-2 conversion) and for a
Hugging Face workload (its own save_pretrained); and clear errors for what it cannot serve."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import serving
from generation import greedy_text
from safetensors.torch import load_file, save_file

from gpuflow.errors import UserError
from gpuflow.export import export_model
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.model import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "def main():"


async def served(source: Path, predict: dict[str, Any]) -> dict[str, Any]:
    """What a server on ``source`` answers: a greedy completion, a prediction, /readyz."""
    app = create_app(ServeSettings(str(source), device="cpu", max_batch_size=2,
                                   engine_process=False))
    async with serving(app) as client:
        completion = await client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        prediction = await client.post("/v1/predict", json=predict)
        ready = (await client.get("/readyz")).json()
    assert completion.status_code == 200, completion.text
    assert prediction.status_code == 200, prediction.text
    return {"text": completion.json()["choices"][0]["text"],
            "predictions": prediction.json()["predictions"], "ready": ready}


def assert_close_json(ours: Any, theirs: Any) -> None:
    """Equal JSON, floats within fp32 rounding (GPT-2 sums attention in another order)."""
    if isinstance(ours, float):
        assert ours == pytest.approx(theirs, abs=1e-5)
    elif isinstance(ours, dict):
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert_close_json(ours[key], theirs[key])
    elif isinstance(ours, list):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert_close_json(a, b)
    else:
        assert ours == theirs


def serve_both(run_dir: Path, export: Path, predict: dict[str, Any]) -> dict[str, Any]:
    """The export's answers, checked equal to the run dir's."""
    from_run, from_export = (asyncio.run(served(source, predict)) for source in (run_dir, export))
    assert from_export["text"] == from_run["text"]
    assert_close_json(from_export["predictions"], from_run["predictions"])
    for key in ("workload", "step"):
        assert from_export["ready"][key] == from_run["ready"][key]
    return from_export


def test_a_textlm_export_serves_what_its_run_does(
        textlm_run: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    """textlm's export is a GPT2LMHeadModel; served in place of the GPT, /v1/completions runs
    through the engine's Hugging Face path and /v1/predict through textlm's codec."""
    run_dir, model = textlm_run
    export, _ = export_model(run_dir, tmp_path / "hf", "hf")
    loaded = load_model(export)
    assert type(loaded.model).__name__ == "GPT2LMHeadModel" and loaded.workload.name == "textlm"
    answers = serve_both(run_dir, export, {"text": PROMPT, "max_new_tokens": 6, "top_k": 256})
    assert answers["text"] == greedy_text(model, PROMPT.encode(), 12)
    with torch.inference_mode():
        probs = torch.softmax(model(torch.tensor([list(PROMPT.encode())]))[0, -1], dim=-1)
    [prediction] = answers["predictions"]
    served_probs = torch.zeros(256)
    for entry in prediction["top"]:
        served_probs[entry["index"]] = entry["probability"]
    torch.testing.assert_close(served_probs, probs, atol=1e-6, rtol=1e-5)
    assert answers["ready"]["workload"] == "textlm" and answers["ready"]["step"] == 3


@pytest.fixture(scope="module")
def gpt2_export(hf_run: tuple[Path, torch.nn.Module],
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    export, _ = export_model(hf_run[0], tmp_path_factory.mktemp("hf-export") / "gpt2", "hf")
    return export


def test_a_hugging_face_workload_export_serves_what_its_run_does(
        hf_run: tuple[Path, torch.nn.Module], gpt2_export: Path) -> None:
    """The export is the model's save_pretrained, without the head tied to the embedding:
    reopened as the workload's own class, every weight is the trained one, the head tied."""
    run_dir, model = hf_run
    loaded = load_model(gpt2_export)
    assert type(loaded.model) is type(model) and loaded.step == 2
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight
    trained = model.state_dict()
    assert loaded.model.state_dict().keys() == trained.keys()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    window = list((PROMPT * 4).encode())[:32]  # the workload's inputs: [N, 32] token ids
    answers = serve_both(run_dir, gpt2_export, {"inputs": [window], "top_k": 3})
    assert answers["text"] == greedy_text(model, PROMPT.encode(), 12)


def broken(export: Path, tmp_path: Path, name: str, content: bytes | None) -> Path:
    """A copy of ``export`` with file ``name`` replaced by ``content`` (None: removed)."""
    copy = Path(shutil.copytree(export, tmp_path / "broken"))
    (copy / name).unlink()
    if content is not None:
        (copy / name).write_bytes(content)
    return copy


def without_one_weight(export: Path) -> bytes:
    weights = load_file(export / "model.safetensors")
    del weights["transformer.h.0.mlp.c_fc.weight"]
    scratch = export.parent / "scratch.safetensors"
    save_file(weights, str(scratch))
    return scratch.read_bytes()


@pytest.mark.parametrize(("name", "content", "message"), [
    ("model.safetensors", None, "cannot be loaded (OSError"),
    ("model.safetensors", b"\x08" + b"\x00" * 15 + b"not a header",
     "cannot be loaded (SafetensorError"),
    ("model.safetensors", without_one_weight,
     "missing: transformer.h.0.mlp.c_fc.weight"),
    ("gpuflow_run.json", b"{\"step\": 2}", "is not the run record"),
    ("gpuflow_run.json", b"not json", "is not the run record"),
])
def test_a_broken_export_is_a_clear_error(gpt2_export: Path, tmp_path: Path, name: str,
                                          content: Any, message: str) -> None:
    if callable(content):
        content = content(gpt2_export)
    with pytest.raises(UserError, match="export the run again") as raised:
        load_model(broken(gpt2_export, tmp_path, name, content))
    assert message in str(raised.value)


def test_an_export_rebuilt_with_another_workload_does_not_fit(gpt2_export: Path) -> None:
    with pytest.raises(UserError, match="do not fit workload 'hf-llama'") as raised:
        load_model(gpt2_export, workload="user_workloads.hf_models:llama")
    assert "missing: lm_head.weight" in str(raised.value)
    assert json.loads((gpt2_export / "gpuflow_run.json").read_text())["step"] == 2
