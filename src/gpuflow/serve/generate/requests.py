"""One request as the server sees it, and the events it sends its route: text deltas
(with log-probabilities when asked), then the finish or the failure. The engine core
(``core.py``) sends token ids; a request turns them into text itself (incremental
detokenizing, stop strings), so that text never crosses to the core."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gpuflow.serve.generate.messages import Occupancy, Output, StepTiming
from gpuflow.serve.generate.sampling import SamplingParams, TokenLogprob
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
    """One request: its prompt and sampling, the tokens and text it received, where its
    events go (``events``, on ``loop``), and its id in the engine core."""

    id: int
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    detokenizer: Detokenizer
    on_cancel: Callable[[Generation], None]
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    submitted: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    # The prompt's log-probabilities (``params.prompt_logprobs``; None for its first token),
    # there once the first event is handed over.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache held, once the first event is

    def __post_init__(self) -> None:
        self.stream = TextStream(self.params.stop)
        self.unsent_logprobs: list[TokenLogprob] = []

    def cancel(self) -> None:
        """Leave the engine at its next step (the client went away, or its deadline
        passed); a no-op once finished."""
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self.on_cancel(self)

    def receive(self, output: Output, observer: EngineObserver | None
                ) -> tuple[list[Event], bool]:
        """The events of one step's ``output``; and whether the core must drop the request
        (a stop string ended it there). Tokens past the finish are never sent on."""
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = list(output.prompt_logprobs)
        self.cached_tokens += output.cached_tokens
        events: list[Event] = []
        for index, token in enumerate(output.tokens):
            if output.logprobs:
                self.unsent_logprobs.append(output.logprobs[index])
            if self._take(token, observer, events):
                return events + self.finish("stop"), output.finish is None
        if output.finish == "stop" and output.error is None:
            self._observe(observer)  # an end-of-sequence id, generated and not sent on
        if output.error is not None:
            self.finished = True
            return [*events, Failed(output.error)], False
        if output.finish is not None:
            return events + self.finish(output.finish), False
        return events, False

    def receive_token(self, token: int, observer: EngineObserver | None
                      ) -> tuple[list[Event], bool]:
        """``receive`` of an output that holds one token and nothing else (``Report.tokens``:
        most outputs of most steps)."""
        events: list[Event] = []
        if self._take(token, observer, events):
            return events + self.finish("stop"), True
        return events, False

    def _take(self, token: int, observer: EngineObserver | None, events: list[Event]) -> bool:
        """Take one generated token: its text's event, if any, into ``events``; whether a
        stop string ended the request there."""
        self._observe(observer)
        self.generated.append(token)
        text = self.stream.feed(self.detokenizer.add(token))
        if text:
            events.append(self._delta(text))
        return self.stream.stopped

    def _observe(self, observer: EngineObserver | None) -> None:
        now = time.monotonic()
        if observer is not None:
            if self.last_token_at is None:
                observer.first_token(now - self.submitted)
            else:
                observer.next_token(now - self.last_token_at)
        self.last_token_at = now

    def finish(self, reason: str) -> list[Event]:
        """The last events: the text still held back (not for a cancelled request), then
        the finish."""
        self.finished = True
        rest = self.stream.finish(self.detokenizer.finish())
        events: list[Event] = []
        if (rest or self.unsent_logprobs) and reason != "cancelled":
            events.append(self._delta(rest))
        return [*events, Done(reason, len(self.prompt), len(self.generated),
                              self.cached_tokens)]

    def _delta(self, text: str) -> Delta:
        """``text`` with the log-probabilities of the tokens taken since the last delta."""
        logprobs = tuple(self.unsent_logprobs)
        self.unsent_logprobs.clear()
        return Delta(text, logprobs)


class EngineObserver(Protocol):
    def first_token(self, seconds: float) -> None: ...
    def next_token(self, seconds: float) -> None: ...
    def occupancy(self, now: Occupancy) -> None: ...
    def step(self, timing: StepTiming) -> None: ...
