"""One request in the generation engine, and the events it sends back to the server:
text deltas (with log-probabilities when asked), then the finish or the failure. A
request takes its tokens itself: which logits a step must return for it, its prompt's
log-probabilities chunk by chunk, and the finish rules of each token it takes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gpuflow.serve.generate.paged import Wanted
from gpuflow.serve.generate.sampling import Sampler, SamplingParams, TokenLogprob, token_logprobs
from gpuflow.serve.generate.scheduler import Chunk, Sequence
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

    def wanted(self, chunk: Chunk) -> Wanted:
        """Every position's logits while ``chunk`` holds prompt tokens whose
        log-probabilities are still wanted; else the last one's if it ends the sequence."""
        scored = self.prompt_logprobs
        if scored is not None and chunk.start + chunk.length > len(scored) - 1 \
                and len(scored) < len(self.prompt):
            return "all"
        return "last" if chunk.final else "none"

    def score_prompt(self, chunk: Chunk, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens ``chunk``'s logits (``[T, V]``, every
        position) predict and that are not scored yet (a preempted sequence recomputes
        chunks already scored)."""
        scored = self.prompt_logprobs
        assert scored is not None
        first = max(chunk.start, len(scored) - 1)
        end = min(chunk.start + chunk.length, len(self.prompt) - 1)
        if end > first:
            scored += token_logprobs(logits[first - chunk.start:end - chunk.start],
                                     self.prompt[first + 1:end + 1],
                                     self.params.prompt_logprobs or 0)

    def take(self, token: int, logits: torch.Tensor, eos_ids: frozenset[int],
             context: int) -> tuple[list[Event], str | None]:
        """Take ``token`` as the sequence's next (``logits``, ``[1, V]``, the model's at its
        position, read only for log-probabilities): the events to send, and why the request
        is finished (``finish`` gives its last events), or None."""
        params = self.params
        if token in eos_ids and not params.ignore_eos:
            return [], "stop"
        self.generated.append(token)
        self.seq.tokens.append(token)
        self.sampler.observe(token)
        if params.logprobs is not None:
            self.unsent_logprobs += token_logprobs(logits, [token], params.logprobs)
        text = self.stream.feed(self.detokenizer.add(token))
        events: list[Event] = [self._delta(text)] if text else []
        if self.stream.stopped:
            return events, "stop"
        if len(self.generated) >= params.max_tokens or self.length >= context:
            return events, "length"
        return events, None

    def finish(self, reason: str) -> list[Event]:
        """The last events: the text still held back (not for a cancelled request), then
        the finish."""
        rest = self.stream.finish(self.detokenizer.finish())
        events: list[Event] = []
        if (rest or self.unsent_logprobs) and reason != "cancelled":
            events.append(self._delta(rest))
        return [*events, Done(reason, len(self.prompt), len(self.generated),
                              self.seq.cached_tokens)]

    def _delta(self, text: str) -> Delta:
        """``text`` with the log-probabilities of the tokens taken since the last delta."""
        logprobs = tuple(self.unsent_logprobs)
        self.unsent_logprobs.clear()
        return Delta(text, logprobs)


@dataclass(frozen=True)
class Occupancy:
    """The engine after a step: sequences running and waiting, KV blocks in use of those
    sequences can hold, preemptions so far, prompt tokens looked up in the prefix cache so
    far and found there, and tokens drafted for speculative decoding so far and accepted."""

    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class StepTiming:
    """One engine step: its rows (sequences) and scheduled tokens (drafts not counted), the
    seconds the model runner's call took (on a GPU, launching its work: the device
    finishes while the tokens are chosen) and the whole step's (scheduling
    excluded: sampling, stop checks and events included)."""

    rows: int
    tokens: int
    forward_s: float
    step_s: float


class EngineObserver(Protocol):
    def first_token(self, seconds: float) -> None: ...
    def next_token(self, seconds: float) -> None: ...
    def occupancy(self, now: Occupancy) -> None: ...
    def step(self, timing: StepTiming) -> None: ...
