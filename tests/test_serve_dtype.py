"""`gpuflow serve --dtype` and `--kv-cache-dtype`: the weights held in the serving dtype (no
autocast over them), the KV cache in theirs unless asked otherwise, and what runs said in
/readyz and /v1/models."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from conftest import serving
from transformers import AutoModelForCausalLM, AutoTokenizer

import gpuflow
from gpuflow.serve.dtypes import kv_cache_dtype, weights_dtype

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Saved(torch.nn.Module):
    """A model whose config says the dtype its checkpoint was saved in."""

    def __init__(self, dtype: Any) -> None:
        super().__init__()
        self.config = type("Config", (), {"dtype": dtype})()


@pytest.mark.parametrize(("asked", "device", "precision", "saved", "expected"), [
    ("auto", "cpu", "fp32", torch.bfloat16, torch.float32),  # a CPU: fp32, autocast as asked
    ("auto", "cpu", "bf16", "bfloat16", torch.float32),
    ("auto", "cuda", "fp32", "bfloat16", torch.bfloat16),  # the checkpoint's
    ("auto", "cuda", "fp32", torch.float16, torch.float16),
    ("auto", "cuda", "fp32", None, torch.float32),
    ("auto", "cuda", "bf16", "float32", torch.bfloat16),  # --precision's, not autocast
    ("bf16", "cpu", "fp32", None, torch.bfloat16),
    ("half", "cuda", "bf16", "bfloat16", torch.float16),
])
def test_the_serving_dtype_rule(asked: str, device: str, precision: str, saved: Any,
                                expected: torch.dtype) -> None:
    assert weights_dtype(asked, torch.device(device), precision, Saved(saved)) == expected


def test_the_kv_cache_takes_the_weights_dtype_unless_asked() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16, "fp32") == torch.bfloat16
    assert kv_cache_dtype("auto", torch.float32, "bf16") == torch.bfloat16  # autocast's
    assert kv_cache_dtype("auto", torch.float32, "fp32") == torch.float32
    assert kv_cache_dtype("float32", torch.bfloat16, "fp32") == torch.float32


PROMPT = "Hello, who are you? Assert statements are a convenient way to insert checks."


def served(path: Any, **options: Any) -> dict[str, Any]:
    """/readyz, /v1/models, the weights' dtypes and the prompt's log-probabilities as the
    server computes them (``echo``), serving ``path`` with ``options``."""
    settings = gpuflow.ServeSettings(source=str(path), device="cpu", max_batch_size=2,
                                     kv_cache_gib=0.02, engine_process=False, **options)
    ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]

    async def scenario() -> dict[str, Any]:
        app = gpuflow.create_app(settings)
        async with serving(app) as client:
            done = (await client.post("/v1/completions", json={
                "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True,
                "logprobs": 0})).json()
            return {"ready": (await client.get("/readyz")).json(),
                    "models": (await client.get("/v1/models")).json()["data"][0],
                    "logprobs": done["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)],
                    "weights": {p.dtype for p in app.state.serve.engine.runner.model
                                .parameters()}}

    return {**asyncio.run(scenario()), "ids": ids}


def reference(path: Any, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """transformers' own log-probabilities of ``ids[1:]``, its model in ``dtype``."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_bf16_weights_serve_without_autocast_and_say_so(hub_models: Any) -> None:
    """``--dtype bfloat16`` on the CPU: bf16 weights and KV cache, said in /readyz and
    /v1/models; the prompt's log-probabilities those of transformers' bf16 model within
    one bf16 step at their largest magnitude (2^-7 of it: 0.13 here; 0.028 measured on an
    AMD EPYC, 0.063 on an Intel Xeon whose bf16 products run on AMX), and not the fp32
    model's (which fp32 weights equal)."""
    path = hub_models["llama"]
    found = served(path, dtype="bfloat16")
    assert found["weights"] == {torch.bfloat16}
    assert found["ready"]["runs_on"] == "cpu, bf16 weights"
    assert found["ready"]["generation"]["kv_cache_dtype"] == "bf16"
    assert found["models"]["dtype"] == "bf16" and found["models"]["kv_cache_dtype"] == "bf16"
    ours = torch.tensor(found["logprobs"])
    bf16, fp32 = (reference(path, found["ids"], dtype) for dtype in (torch.bfloat16,
                                                                     torch.float32))
    assert (ours - bf16).abs().max() <= 2**-7 * bf16.abs().max()
    assert (ours - fp32).abs().max() > 1e-3


def test_fp32_weights_with_a_bf16_kv_cache(hub_models: Any) -> None:
    """fp32 weights, keys and values kept in bf16: the fp32 model's log-probabilities within
    the cache's rounding (0.014 measured), not exactly."""
    path = hub_models["llama"]
    found = served(path, kv_cache_dtype="bfloat16")
    assert found["weights"] == {torch.float32} and found["ready"]["runs_on"] == "cpu, fp32"
    assert found["models"] == {**found["models"], "dtype": "fp32", "kv_cache_dtype": "bf16"}
    fp32 = reference(path, found["ids"], torch.float32)
    assert 0 < (torch.tensor(found["logprobs"]) - fp32).abs().max() < 0.03
