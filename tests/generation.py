"""Shared by the generation tests: the greedy reference that recomputes every prefix, and a
harness that runs requests through a generation engine."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import torch

from gpuflow.serve.generate.engine import GenerationEngine
from gpuflow.serve.generate.requests import Delta, Done, Generation
from gpuflow.serve.generate.sampling import SamplingParams


def greedy_reference(model: torch.nn.Module, prompt: bytes, count: int) -> list[int]:
    """Greedy byte tokens from the model's own forward over the whole prefix at every token
    (a gpuflow GPT returns logits, a Hugging Face model an output holding them)."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            output = model(torch.tensor([tokens]))
            logits = getattr(output, "logits", output)
            tokens.append(int(logits[0, -1, :256].argmax()))
    return tokens[len(prompt):]


def greedy_text(model: torch.nn.Module, prompt: bytes, count: int) -> str:
    """The greedy reference as the server's text (invalid UTF-8 replaced)."""
    return bytes(greedy_reference(model, prompt, count)).decode("utf-8", errors="replace")


async def completion(generation: Generation) -> tuple[str, Done]:
    """The text one request streamed, and how it ended."""
    parts = []
    while True:
        event = await generation.events.get()
        if isinstance(event, Done):
            return "".join(parts), event
        assert isinstance(event, Delta), event
        parts.append(event.text)


class Completed(NamedTuple):
    text: str
    tokens: list[int]
    done: Done


def through_engine(engine: GenerationEngine, requests: list[tuple[bytes, SamplingParams]],
                   first: int, adapters: list[int] | None = None) -> list[Completed]:
    """Each request's completion (under the LoRA adapter of its id in ``adapters``, 0 or
    none: the base): the ``first`` go in once the engine is warm, the rest a moment later,
    joining a running batch."""
    ids = adapters or [0] * len(requests)

    async def scenario() -> list[Completed]:
        engine.start()
        try:
            await asyncio.to_thread(engine.wait_warm, 120)
            generations = [engine.submit(list(p), params, adapter) for (p, params), adapter
                           in zip(requests[:first], ids, strict=False)]
            await asyncio.sleep(0.005)
            generations += [engine.submit(list(p), params, adapter) for (p, params), adapter
                            in zip(requests[first:], ids[first:], strict=True)]
            done = await asyncio.gather(*(completion(g) for g in generations))
            return [Completed(text, g.generated, end)
                    for g, (text, end) in zip(generations, done, strict=True)]
        finally:
            engine.stop()

    return asyncio.run(scenario())


def greedy(prompts: list[bytes], budgets: list[int]) -> list[tuple[bytes, SamplingParams]]:
    """Greedy requests: each prompt with its token budget."""
    return [(p, SamplingParams(max_tokens=n, temperature=0.0))
            for p, n in zip(prompts, budgets, strict=True)]
