"""One request in the generation engine, and the events it sends back to the server:
text deltas (with log-probabilities when asked), then the finish or the failure."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from gpuflow.serve.generate.sampling import Sampler, SamplingParams, TokenLogprob
from gpuflow.serve.generate.scheduler import Sequence
from gpuflow.serve.generate.text import TextStream
from gpuflow.serve.generate.tokenizer import Detokenizer


class WaitingFull(Exception):
    """As many requests wait to start as the engine queues (``--max-queue``)."""


@dataclass(frozen=True)
class Delta:
    """New text, and the log-probabilities of the tokens that made it when asked for."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


@dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Done | Failed


@dataclass(eq=False)
class Generation:
    """One request in the engine: its prompt and sampling, what it produced, where its
    events go, and its ``seq`` in the scheduler (a request that wants its prompt's
    log-probabilities computes its whole prompt itself, so that they are exact)."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    detokenizer: Detokenizer
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    # The prompt's log-probabilities (``params.prompt_logprobs``; None for its first token),
    # complete once the first event is handed over (gathered chunk by chunk).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        self.seq = Sequence.of(self.prompt, reuse_prefix=self.params.prompt_logprobs is None)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.sampler = Sampler(self.params, self.prompt)
        self.stream = TextStream(self.params.stop)
        self.unsent_logprobs: list[TokenLogprob] = []

    def cancel(self) -> None:
        """Leave at the next step (the client went away, or its deadline passed)."""
        self.cancelled = True

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)


@dataclass(frozen=True)
class Occupancy:
    """The engine after a step: sequences running and waiting, KV blocks in use of those
    sequences can hold, preemptions so far, and prompt tokens looked up in the prefix
    cache so far and found there."""

    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int


class EngineObserver(Protocol):
    def first_token(self, seconds: float) -> None: ...
    def next_token(self, seconds: float) -> None: ...
    def occupancy(self, now: Occupancy) -> None: ...
