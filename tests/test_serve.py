"""The HTTP server: real uvicorn on a free loopback port, driven by httpx in the same loop."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import subprocess
import sys
import threading
import time
import wave
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import numpy as np
import pytest
import torch
from conftest import ROOT, eventually, run_cli, serving
from fastapi import FastAPI
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from gpuflow.cli import main
from gpuflow.models.gpt import GPT, GPTConfig
from gpuflow.models.speech import SpeechClassifier
from gpuflow.parallel.env import free_port
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.engine import Engine, EngineOptions
from gpuflow.serve.errors import invalid_body
from gpuflow.serve.model import LoadedModel, Runner
from gpuflow.serving import PredictRequest
from gpuflow.workload import Workload
from gpuflow.workloads import digits
from gpuflow.workloads.speech_codec import SpeechCodec
from gpuflow.workloads.text_codec import TextCodec


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


class Probe(nn.Module):
    """A 4-feature classifier that records the rows it sees and the thread it ran on, can
    hold a batch at a gate or be slow, and raises on a batch holding a row whose first
    feature is -1."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.seen: list[float] = []
        self.threads: list[str] = []
        self.delay_s = 0.0
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x[:, 0].tolist()
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        self.entered.set()
        assert self.gate.wait(30)
        if bool((x[:, 0] == -1).any()):
            raise RuntimeError("poisoned row")
        return self.linear(x)


def probe_engine(probe: Probe, options: EngineOptions) -> Engine:
    data = TensorDataset(torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64))
    return Engine(LoadedModel(Workload("probe", probe.eval(), data), {}, 0, Path("probe")),
                  options)


def probe_app(probe: Probe, **settings: Any) -> FastAPI:
    # Batches held at the probe's gate must not hold the event loop (and the test) too.
    serve = ServeSettings(**{"source": "probe", "device": "cpu", "max_batch_size": 8,
                             "inline_below_ms": 0, **settings})
    return create_app(serve, load=lambda: probe_engine(probe, serve.engine_options()))


async def holding_the_model(probe: Probe, client: httpx.AsyncClient, value: float
                            ) -> asyncio.Task[httpx.Response]:
    """A request whose batch holds the model at the probe's gate until it is set."""
    probe.entered.clear()
    probe.gate.clear()
    running = asyncio.create_task(client.post("/v1/predict", json=rows(value)))
    assert await asyncio.to_thread(probe.entered.wait, 10)
    return running


def api_error(reply: httpx.Response, status: int) -> dict[str, Any]:
    """The error of ``reply``, checked to be OpenAI's envelope with ``status``."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert {"message", "type", "param", "code"} <= error.keys(), error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status in (400, 404, 405, 413, 422)
                             else "authentication_error" if status == 401 else "server_error")
    assert error["param"] is None or isinstance(error["param"], str)
    return error


def rows(*first: float) -> dict[str, Any]:
    return {"inputs": [[value, 0.0, 0.0, 0.0] for value in first]}


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits model trained by the CLI, as a user would."""
    run_dir = tmp_path_factory.mktemp("serve") / "digits"
    done = run_cli("train", "--workload", "digits", "--max-steps", "12", "--eval-every", "0",
                   "--log-every", "4", "--no-progress", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return run_dir


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


def test_a_lone_request_runs_at_once_however_long_batches_may_wait() -> None:
    async def scenario() -> None:
        app = probe_app(Probe(), max_wait_ms=10_000)
        async with serving(app) as client:
            replies = [(await client.post("/v1/predict", json=rows(i))).json()
                       for i in range(3)]
        # Nobody else was on the way: no request waited for company.
        assert all(r["batch_rows"] == 1 and r["queue_ms"] < 1000 for r in replies), replies

    run(scenario)


def test_fast_lone_requests_run_on_the_event_loop_and_slow_ones_are_handed_off() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, inline_below_ms=50)
        async with serving(app) as client:
            loop_thread = threading.current_thread().name
            probe.threads.clear()  # the warm-up's
            probe.seen.clear()
            for value in range(3):
                assert (await client.post("/v1/predict", json=rows(value))).status_code == 200
            # A key's first lone run is timed on the batch thread; known fast, the next run
            # where the request arrived.
            assert probe.threads[0].startswith("gpuflow-batch")
            assert probe.threads[1:] == [loop_thread] * 2
            probe.delay_s = 0.4  # the model turns slow: the estimate passes 50 ms
            replies = [await client.post("/v1/predict", json=rows(value)) for value in (3, 4)]
        assert [r.status_code for r in replies] == [200, 200]
        assert probe.threads[3] == loop_thread and probe.threads[4].startswith("gpuflow-batch")
        assert probe.seen == [0.0, 1.0, 2.0, 3.0, 4.0]

    run(scenario)


def test_requests_arriving_while_a_batch_runs_form_the_next_batch() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, max_wait_ms=10_000)
        async with serving(app) as client:
            first = await holding_the_model(probe, client, 0)
            later = [asyncio.create_task(client.post("/v1/predict", json=rows(i)))
                     for i in range(1, 8)]
            await eventually(lambda: app.state.serve.batcher.depth == 7)
            probe.gate.set()
            replies = [await first, *await asyncio.gather(*later)]
            text = (await client.get("/metrics")).text
        assert [r.status_code for r in replies] == [200] * 8
        assert [r.json()["batch_rows"] for r in replies] == [1] + [7] * 7
        # The seven ran as soon as the model was free, not after --max-wait-ms.
        assert all(r.json()["queue_ms"] < 5000 for r in replies[1:])
        assert metric(text, "gpuflow_batch_size_count") == 2
        assert metric(text, "gpuflow_batch_size_sum") == 8
        assert metric(text, 'gpuflow_requests_total{status="200"}') == 8
        assert metric(text, "gpuflow_request_latency_seconds_count") == 8
        assert metric(text, "gpuflow_queue_time_seconds_count") == 8
        assert metric(text, "gpuflow_compute_time_seconds_count") == 8
        assert metric(text, "gpuflow_queue_depth") == 0
        assert metric(text, "gpuflow_in_flight_requests") == 0

    run(scenario)


def test_a_full_queue_answers_503_with_retry_after() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, max_queue=1, max_wait_ms=0)
        async with serving(app) as client:
            running = await holding_the_model(probe, client, 1)
            queued = asyncio.create_task(client.post("/v1/predict", json=rows(2)))
            await eventually(lambda: app.state.serve.batcher.depth == 1)
            refused = await client.post("/v1/predict", json=rows(3))
            probe.gate.set()
            assert (await running).status_code == 200 and (await queued).status_code == 200
        assert api_error(refused, 503)["code"] == "queue_full"
        assert refused.headers["retry-after"] == "1"
        assert "queue is full" in refused.json()["error"]["message"]
        assert 3.0 not in probe.seen

    run(scenario)


def test_a_deadline_passing_in_the_queue_gives_504_and_the_model_never_sees_it() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, max_wait_ms=0)
        async with serving(app) as client:
            probe.seen.clear()
            running = await holding_the_model(probe, client, 1)
            late = await client.post("/v1/predict", json={**rows(7), "timeout_ms": 50})
            # The first batch still holds the model: the deadline fired while waiting.
            assert late.status_code == 504 and not probe.gate.is_set()
            assert app.state.serve.batcher.depth == 0
            probe.gate.set()
            assert (await running).status_code == 200
            after = await client.post("/v1/predict", json=rows(2))
            text = (await client.get("/metrics")).text
        assert api_error(late, 504)["code"] == "deadline_exceeded"
        assert after.status_code == 200
        assert probe.seen == [1.0, 2.0]
        assert metric(text, 'gpuflow_requests_total{status="504"}') == 1

    run(scenario)


def test_a_client_that_disconnects_leaves_the_queue() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, max_wait_ms=0)
        async with serving(app) as client:
            probe.seen.clear()
            running = await holding_the_model(probe, client, 1)
            leaving = asyncio.create_task(client.post("/v1/predict", json=rows(5)))
            await eventually(lambda: app.state.serve.batcher.depth == 1)
            leaving.cancel()  # closes its connection
            await eventually(lambda: app.state.serve.batcher.depth == 0)
            probe.gate.set()
            assert (await running).status_code == 200
            text = (await client.get("/metrics")).text
        assert probe.seen == [1.0]
        assert metric(text, 'gpuflow_requests_total{status="499"}') == 1

    run(scenario)


def test_a_failing_batch_fails_only_its_requests_and_serving_goes_on() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, max_wait_ms=0)
        async with serving(app) as client:
            healthy = await holding_the_model(probe, client, 1)
            # Queued together behind the held batch, so they form the next batch.
            poisoned = [asyncio.create_task(client.post("/v1/predict", json=rows(value)))
                        for value in (-1, 4)]
            await eventually(lambda: app.state.serve.batcher.depth == 2)
            probe.gate.set()
            first = await healthy
            failed = await asyncio.gather(*poisoned)
            after = await client.post("/v1/predict", json=rows(2))
        assert first.status_code == 200 and after.status_code == 200
        assert [r.status_code for r in failed] == [500, 500]
        body = api_error(failed[0], 500)
        assert body["code"] == "batch_failed" and "poisoned row" in body["message"]

    run(scenario)


def test_an_error_no_handler_answers_gives_500_and_serving_goes_on() -> None:
    probe = Probe()
    broken = [True]

    def load() -> Engine:
        engine = probe_engine(probe, EngineOptions(device="cpu"))
        answer = engine.codec.format

        def format(output: Any, parsed: PredictRequest) -> Any:
            if broken[0]:
                raise RuntimeError("the answer could not be written")
            return answer(output, parsed)

        engine.codec.format = format  # type: ignore[method-assign]
        return engine

    async def scenario() -> None:
        app = create_app(ServeSettings(source="probe", device="cpu", max_batch_size=8),
                         load=load)
        async with serving(app) as client:
            failed = await client.post("/v1/predict", json=rows(1))
            broken[0] = False
            after = await client.post("/v1/predict", json=rows(2))
            text = (await client.get("/metrics")).text
        assert api_error(failed, 500) == {
            "message": "RuntimeError: the answer could not be written", "type": "server_error",
            "param": None, "code": "internal"}
        assert after.status_code == 200
        assert metric(text, 'gpuflow_requests_total{status="500"}') == 1

    run(scenario)


def test_token_body_limit_unknown_routes_and_methods_answer_in_the_envelope() -> None:
    async def scenario() -> None:
        app = probe_app(Probe(), token="s3cret", max_body_bytes=200)
        async with serving(app) as client:
            missing = await client.post("/v1/predict", json=rows(1))
            wrong = await client.get("/healthz", headers={"Authorization": "Bearer nope"})
            auth = {"Authorization": "Bearer s3cret"}
            good = await client.post("/v1/predict", json=rows(1), headers=auth)
            big = await client.post("/v1/predict", json=rows(*range(40)), headers=auth)

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(10):
                    yield b" " * 50

            chunked = await client.post("/v1/predict", content=chunks(),
                                        headers={**auth, "Content-Type": "application/json"})
            bad = await client.post("/v1/predict", json={"inputs": [[1, 2]]}, headers=auth)
            invalid = await client.post("/v1/predict", json={"inputs": [[1, 2, 3, 4]],
                                                             "top_k": "many"}, headers=auth)
            nowhere = await client.post("/v1/nowhere", json={}, headers=auth)
            wrong_method = await client.get("/v1/predict", headers=auth)
            after = await client.post("/v1/predict", json=rows(1), headers=auth)
        assert api_error(missing, 401)["code"] == "unauthorized"
        assert api_error(wrong, 401)["code"] == "unauthorized"
        assert missing.headers["www-authenticate"] == "Bearer"
        assert good.status_code == 200 and after.status_code == 200
        assert api_error(big, 413)["code"] == "body_too_large"
        assert api_error(chunked, 413)["code"] == "body_too_large"
        assert "[N, 4]" in api_error(bad, 422)["message"]
        refused = api_error(invalid, 422)
        assert refused["code"] == "invalid_request" and refused["param"] == "top_k"
        assert refused["details"][0]["loc"] == ["top_k"]
        assert api_error(nowhere, 404)["code"] == "not_found"
        assert "/v1/nowhere" in nowhere.json()["error"]["message"]
        assert api_error(wrong_method, 405)["code"] == "method_not_allowed"
        assert wrong_method.headers["allow"] == "POST"

    run(scenario)


class Part(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[Part, Field(discriminator="type")]]


class Chat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: list[Message]


@pytest.mark.parametrize(("body", "param", "said"), [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'user'"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text", "valid string"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "valid string or Input should be a valid list"),
    ({"messages": [], "tools": []}, "tools", "Unrecognized request argument supplied: tools"),
])
def test_a_body_error_names_the_field_as_the_client_spelled_it(
        body: dict[str, Any], param: str, said: str) -> None:
    """The dotted path to the field at fault, without the names pydantic gives a union's
    alternatives (``content.list[...].0``), the furthest any alternative got."""
    with pytest.raises(ValidationError) as raised:
        Chat.model_validate(body)
    error = invalid_body(raised.value, Chat)
    assert (error.status, error.param, error.code) == (400, param, "invalid_request")
    assert said in error.message and param.split(".")[0] in error.message


def test_readyz_turns_200_only_after_loading_and_warm_up() -> None:
    probe = Probe()
    loading = threading.Event()

    def load() -> Engine:
        assert loading.wait(30)
        return probe_engine(probe, EngineOptions(device="cpu", max_batch_size=4))

    async def scenario() -> None:
        app = create_app(ServeSettings("probe", max_batch_size=4), load=load)
        async with serving(app, ready=False) as client:
            alive = await client.get("/healthz")
            before = await client.get("/readyz")
            early = await client.post("/v1/predict", json=rows(1))
            probe.seen.clear()
            loading.set()
            await asyncio.wait_for(app.state.serve.ready.wait(), 30)
            after = await client.get("/readyz")
            docs = await client.get("/openapi.json")
        assert alive.status_code == 200
        assert before.status_code == 503 and before.json()["state"] == "loading"
        assert api_error(early, 503)["code"] == "not_ready"
        assert after.status_code == 200 and after.json()["warmup_s"] >= 0
        # Every warm-up batch ran before ready: eager, one row per kind of input.
        warmup = app.state.serve.engine.warmup_batches()
        assert len(probe.seen) == sum(len(batch) for _, batch in warmup) == 1
        paths = docs.json()["paths"]
        for path, field in (("/v1/predict", "inputs"), ("/v1/completions", "prompt")):
            body = paths[path]["post"]["requestBody"]["content"]["application/json"]
            assert field in body["schema"]["properties"], path

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
    prompt = list(b"def f(x):")
    with torch.inference_mode():
        for _ in range(6):
            prompt.append(int(model(torch.tensor([prompt]))[0, -1].argmax()))
    assert alone[0][0] == prompt[-6:]
    reply = codec.format(alone[0], requests[0])
    assert reply["completion"] == bytes(prompt[-6:]).decode("utf-8", errors="replace")
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
    """A plain nn.Module taking two tensors as a dict, trained by the CLI."""
    run_dir = tmp_path_factory.mktemp("serve") / "masked"
    done = run_cli("train", "--workload", "user_workloads:masked", "--max-steps", "20",
                   "--eval-every", "0", "--no-progress", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
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
