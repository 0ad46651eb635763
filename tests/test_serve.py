"""Serving a trained run: predictions equal to the model run directly, the codecs (images,
text, audio, dict inputs), refusals at start-up, and the serving benchmark."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, api_error, run_cli, serving
from generation import greedy_reference, greedy_text
from PIL import Image
from safetensors.torch import load_file
from serve_probe import run

from gpuflow.cli import main
from gpuflow.models.gpt import GPT, GPTConfig
from gpuflow.models.speech import SpeechClassifier
from gpuflow.parallel.env import free_port
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.model import Runner
from gpuflow.serving import PredictRequest
from gpuflow.workloads import digits
from gpuflow.workloads.speech_codec import SpeechCodec
from gpuflow.workloads.text_codec import TextCodec


@pytest.fixture
def digits_run(short_digits_run: tuple[Path, str]) -> Path:
    return short_digits_run[0]


def test_served_predictions_match_the_trained_model_run_directly(digits_run: Path) -> None:
    workload = digits.build()
    [checkpoint] = (digits_run / "checkpoints").iterdir()
    workload.model.load_state_dict(load_file(checkpoint / "model.safetensors"))
    images = torch.stack([workload.val_dataset[i][0] for i in range(6)])
    with torch.inference_mode():
        expected = torch.softmax(workload.model.eval()(images), dim=-1)
    raw_pixels, _ = digits.load_digits_tensors()
    pixels = (raw_pixels[0, 0] * 255).round()
    png = io.BytesIO()
    Image.fromarray(pixels.numpy().astype(np.uint8)).save(png, format="PNG")

    async def scenario() -> None:
        app = create_app(ServeSettings(str(digits_run), device="cpu", max_batch_size=8))
        async with serving(app) as client:
            reply = (await client.post("/v1/predict",
                                       json={"inputs": images.tolist(), "top_k": 10})).json()
            by_pixels = (await client.post("/v1/predict",
                                           json={"pixels": pixels.tolist()})).json()
            by_png = (await client.post("/v1/predict", json={
                "image": base64.b64encode(png.getvalue()).decode()})).json()
            ready = (await client.get("/readyz")).json()
        assert ready["ready"] and ready["workload"] == "digits" and ready["runs_on"] == "cpu, fp32"
        assert reply["model"] == {"workload": "digits", "step": 12}
        assert reply["queue_ms"] >= 0 and reply["compute_ms"] > 0
        for prediction, probs in zip(reply["predictions"], expected, strict=True):
            assert prediction["index"] == int(probs.argmax())
            served = torch.zeros(10)
            for entry in prediction["top"]:
                served[entry["index"]] = entry["probability"]
            torch.testing.assert_close(served, probs, atol=1e-5, rtol=1e-4)
        assert by_png["predictions"][0]["index"] == by_pixels["predictions"][0]["index"]
        assert by_png["predictions"][0]["probability"] == pytest.approx(
            by_pixels["predictions"][0]["probability"], abs=1e-5)

    run(scenario)


def test_half_precision_and_cuda_graphs_fall_back_clearly_on_a_cpu() -> None:
    model = digits.build().model.eval()
    x = torch.randn(4, 1, 8, 8)
    bf16 = Runner(model, device="cpu", precision="bf16", cuda_graphs=True)
    assert bf16.describe() == ("cpu, bf16 autocast over fp32 weights; "
                               "CUDA graphs need a CUDA device; running without them")
    assert not bf16.static_shapes
    with torch.inference_mode():
        reference = model(x)
    out = bf16(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, atol=0.1, rtol=0.05)
    assert "slower than fp32" in Runner(model, device="cpu", precision="fp16").describe()


def test_text_generation_batches_prompts_of_different_lengths_exactly() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, layers=2, dim=32, heads=2)).eval()
    codec, runner = TextCodec(seq_len=64), Runner(model, device="cpu")
    requests = [PredictRequest(text="def f(x):", max_new_tokens=6),
                PredictRequest(text="a much longer prompt than the first one", max_new_tokens=3)]
    decoded = [codec.decode(r) for r in requests]
    assert decoded[0].key == ("text", 16) and decoded[1].key == ("text", 64)
    alone = [codec.run(runner, d.key, d.rows)[0] for d in decoded]
    together = codec.run(runner, ("text", 64), [d.rows[0] for d in decoded])
    for (tokens, probs), (tokens2, probs2) in zip(alone, together, strict=True):
        assert tokens == tokens2
        torch.testing.assert_close(probs, probs2, atol=1e-5, rtol=1e-4)
    assert alone[0][0] == greedy_reference(model, b"def f(x):", 6)
    reply = codec.format(alone[0], requests[0])
    assert reply["completion"] == greedy_text(model, b"def f(x):", 6)
    assert len(reply["top"]) == 5


def test_speech_takes_base64_wav_and_masks_padding() -> None:
    torch.manual_seed(0)
    model = SpeechClassifier(num_classes=10, dim=32, depth=1, heads=2).eval()
    codec, runner = SpeechCodec(10, sample_rate=8000), Runner(model, device="cpu")
    clip = (np.sin(np.arange(3000) / 7) * 12000).astype("<i2")
    wav = io.BytesIO()
    with wave.open(wav, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(8000)
        writer.writeframes(clip.tobytes())
    decoded = codec.decode(PredictRequest(audio=base64.b64encode(wav.getvalue()).decode()))
    assert decoded.key == ("audio", 4096)
    torch.testing.assert_close(decoded.rows[0], torch.from_numpy(clip / 32768.0).float())
    with torch.inference_mode():
        direct = torch.softmax(model(decoded.rows[0][None], torch.tensor([3000])), dim=-1)[0]
    served = codec.run(runner, decoded.key, decoded.rows)[0]
    torch.testing.assert_close(served, direct, atol=1e-4, rtol=1e-3)


def test_serve_refuses_a_public_address_without_a_token(
        digits_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(digits_run), "--host", "0.0.0.0"]) == 2
    assert "--token" in capsys.readouterr().err
    assert main(["serve", str(digits_run / "nothing")]) == 2
    assert "neither a gpuflow run dir" in capsys.readouterr().err


def test_serving_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    dynamic, single = result["runs"]["dynamic"], result["runs"]["max_batch_size_1"]
    for figures in (dynamic, single):
        assert figures["requests"] > 0 and figures["errors"] == 0
        assert figures["p50_ms"] <= figures["p99_ms"]
    assert single["mean_batch_rows"] == 1
    assert result["machine"]["usable_cores"] >= 1 and result["versions"]["torch"]


@pytest.fixture(scope="module")
def masked_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain nn.Module taking two tensors as a dict, trained by the CLI (its main(), in
    this process)."""
    run_dir = tmp_path_factory.mktemp("serve") / "masked"
    assert main(["train", "--workload", "user_workloads:masked", "--max-steps", "20",
                 "--eval-every", "0", "--no-progress", "--run-dir", str(run_dir)]) == 0
    return run_dir


def test_a_dict_input_model_is_served_with_the_models_own_answers(masked_run: Path) -> None:
    from user_workloads import masked

    workload = masked()
    [checkpoint] = (masked_run / "checkpoints").iterdir()
    workload.model.load_state_dict(load_file(checkpoint / "model.safetensors"))
    samples = [workload.val_dataset[i][0] for i in range(5)]
    features = torch.stack([s["features"] for s in samples])
    mask = torch.stack([s["mask"] for s in samples])
    with torch.inference_mode():
        expected = torch.softmax(workload.model.eval()(features, mask), dim=-1)
    body = {"inputs": {"features": features.tolist(), "mask": mask.tolist()}, "top_k": 4}
    bad = {
        "missing": ({"features": features.tolist()}, "inputs is missing 'mask'"),
        "extra": ({**body["inputs"], "noise": [[0]]}, "inputs has unknown 'noise'"),
        "dtype": ({**body["inputs"], "mask": (mask * 0.5).tolist()},
                  "inputs.mask holds fractional numbers; this model takes integers: "
                  "[N, 16] int64"),
        "shape": ({**body["inputs"], "features": features[:, :3].tolist()},
                  "inputs.features has shape [5, 3]; this model takes [N, 16] float32"),
    }

    async def scenario() -> None:
        app = create_app(ServeSettings(str(masked_run), device="cpu", max_batch_size=8))
        async with serving(app) as client:
            reply = (await client.post("/v1/predict", json=body)).json()
            refused = {name: await client.post("/v1/predict", json={"inputs": inputs})
                       for name, (inputs, _) in bad.items()}
        for prediction, probs in zip(reply["predictions"], expected, strict=True):
            served = torch.zeros(4)
            for entry in prediction["top"]:
                served[entry["index"]] = entry["probability"]
            torch.testing.assert_close(served, probs, atol=1e-6, rtol=1e-5)
        for name, (_, message) in bad.items():
            error = api_error(refused[name], 422)
            assert error["code"] == "invalid_input" and message in error["message"], error

    run(scenario)


def test_a_server_whose_model_cannot_be_built_exits_with_the_reason(masked_run: Path) -> None:
    started = time.monotonic()
    result = run_cli("serve", str(masked_run), "--workload", "user_workloads:unbuildable",
                     "--port", str(free_port()), timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "the model's configuration file is missing" in result.stderr.splitlines()[-1]
    assert time.monotonic() - started < 60
