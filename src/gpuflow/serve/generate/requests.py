"""One request in the generation engine, and the events it sends back to the server:
text deltas (with log-probabilities when asked), then the finish or the failure."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from gpuflow.serve.generate.sampling import Sampler, SamplingParams, TokenLogprob
from gpuflow.serve.generate.text import TextStream
from gpuflow.serve.generate.tokenizer import Detokenizer


class WaitingFull(Exception):
    """As many requests wait for a slot as the engine queues."""


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


@dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Done | Failed


@dataclass(eq=False)
class Generation:
    """One request in the engine: its prompt and sampling, what it produced, where its
    events go."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    detokenizer: Detokenizer
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    slot: int | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    # The prompt's log-probabilities (``params.prompt_logprobs``; None for its first token),
    # set by the engine thread before the first event is handed over.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params, self.prompt)
        self.stream = TextStream(self.params.stop)
        self.unsent_logprobs: list[TokenLogprob] = []

    def cancel(self) -> None:
        """Leave at the next step (the client went away, or its deadline passed)."""
        self.cancelled = True

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)


class EngineObserver(Protocol):
    def first_token(self, seconds: float) -> None: ...
    def next_token(self, seconds: float) -> None: ...
    def occupancy(self, active: int, waiting: int, slots: int) -> None: ...
