"""``gpuflow serve --quantize int8``: torchao's int8 weight-only linear layers keep the logits
of gpuflow's GPT and of a Llama within 2% of their largest fp32 logit, the generation
engine's paged forwards decode the quantized model as its own forward does, and the server
and CLI say what runs or refuse what cannot."""

from __future__ import annotations

import asyncio
import copy
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import serving
from generation import greedy, greedy_reference, greedy_text, through_engine
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from gpuflow.cli import main
from gpuflow.errors import UserError
from gpuflow.models.gpt import GPT, GPTConfig
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.generate.build import build_engine
from gpuflow.serve.generate.limits import EngineLimits
from gpuflow.serve.generate.llama import LlamaDecoder
from gpuflow.serve.generate.models import paged_lm
from gpuflow.serve.quantize import quantize_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# int8 with a scale per output row rounds each weight by at most half a step of 1/127 of
# its row's largest: measured 0.4% (GPT) and 1.0% (Llama) of the largest logit here.
LOGIT_ERROR = 0.02


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(layers=2, dim=64, heads=4, seq_len=64)).eval()


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).eval()


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        output = model(tokens)
    return getattr(output, "logits", output)


@pytest.mark.parametrize("build", [tiny_gpt, tiny_llama], ids=["textlm-gpt", "llama"])
def test_int8_logits_stay_within_the_stated_error_of_fp32(build: Callable[[], nn.Module]
                                                        ) -> None:
    model = build()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    reference = logits(model, tokens)
    quantized = quantize_weights(model, "int8")
    error = (logits(model, tokens) - reference).abs().max()
    assert 0 < error <= LOGIT_ERROR * reference.abs().max()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert quantized.layers == sum(type(m.weight).__name__ == "Int8Tensor" for m in linears)
    if isinstance(model, GPT):  # the head tied to the embedding stays as it is
        assert quantized.tied == 1 and model.lm_head.weight is model.tok_emb.weight
    else:
        assert quantized.tied == 0 and quantized.layers == len(linears) == 15


def test_the_llama_forward_decodes_int8_weights_as_transformers_does() -> None:
    model = tiny_llama()
    quantize_weights(model, "int8")
    lm = paged_lm(model, torch.float32)
    assert isinstance(lm, LlamaDecoder)
    prompts, budgets = [b"def f(x):", b"import torch", b"a"], [8, 5, 10]
    engine = build_engine(lm, 64, EngineLimits(2, 64), torch.inference_mode)
    done = through_engine(engine, greedy(prompts, budgets), first=2)
    assert [c.tokens for c in done] == [greedy_reference(model, p, n)
                                        for p, n in zip(prompts, budgets, strict=True)]


def test_the_server_generates_and_predicts_with_int8_weights(
        textlm_run: tuple[Path, GPT]) -> None:
    run_dir, model = textlm_run
    quantized = copy.deepcopy(model)
    quantize_weights(quantized, "int8")
    expected = greedy_text(quantized, b"def main():", 10)

    async def scenario() -> tuple[dict, str, int]:
        app = create_app(ServeSettings(str(run_dir), device="cpu", max_batch_size=2,
                                       quantize="int8", engine_process=False))
        async with serving(app) as client:
            ready = (await client.get("/readyz")).json()
            completion = await client.post("/v1/completions", json={
                "prompt": "def main():", "max_tokens": 10, "temperature": 0})
            predicted = await client.post("/v1/predict", json={"text": "def main():"})
        return ready, completion.json()["choices"][0]["text"], predicted.status_code

    ready, text, predicted = asyncio.run(scenario())
    assert ready["runs_on"] == ("cpu, fp32, int8 weights in 8 linear layers (69% of the "
                                "parameters, per-row scales; 1 tied to another module kept)")
    assert text == expected and predicted == 200


def test_bad_values_are_refused_naming_the_fix(textlm_run: tuple[Path, GPT],
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, _ = textlm_run
    assert main(["serve", str(run_dir), "--quantize", "int4"]) == 2
    assert "--quantize int4 is not a scheme gpuflow serves; use int8" in capsys.readouterr().err
    with pytest.raises(UserError, match="has no linear layers: drop --quantize"):
        quantize_weights(nn.Sequential(nn.Conv1d(2, 2, 3)), "int8")
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # as if not installed
    assert main(["serve", str(run_dir), "--quantize", "int8"]) == 2
    assert "pip install 'gpuflow[fp8]'" in capsys.readouterr().err
