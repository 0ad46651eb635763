"""Choosing each sequence's next token: greedy, or sampled with temperature, top-k, top-p."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. ``temperature`` 0 is greedy; ``seed`` makes a sampled
    completion repeatable (each request draws from its own generator)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits[V]`` with everything outside the top-k and the top-p nucleus at -inf."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (its last token included).
        drop = cumulative - torch.softmax(ordered, dim=-1) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop),
                                    float("-inf"))
    return logits


class Sampler:
    """One request's token choice, with its own random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        # Not torch.seed(): it reseeds torch's global generators on every device backend,
        # which costs more than a greedy request's whole admission.
        self.generator.manual_seed(params.seed if params.seed is not None
                                   else secrets.randbits(63))

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from ``logits[V]`` (on the CPU, in fp32)."""
        params = self.params
        if params.temperature == 0.0:
            return int(logits.argmax())
        filtered = filter_logits(logits / params.temperature, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def choose_tokens(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """The next token of each row of ``logits[B, V]`` (on the CPU, in fp32): greedy rows
    by one argmax over the batch, sampled rows each from its own generator, so a row's
    choice does not depend on what it is batched with."""
    greedy = [s.params.temperature == 0.0 for s in samplers]
    best = logits.argmax(dim=-1).tolist() if any(greedy) else []
    return [best[row] if is_greedy else sampler.choose(logits[row])
            for row, (sampler, is_greedy) in enumerate(zip(samplers, greedy, strict=True))]
