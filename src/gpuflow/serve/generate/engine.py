"""Continuous batching over a KV cache allocated once.

The engine owns ``slots`` cache rows and a thread that loops: admit waiting requests into
free slots (each prompt is prefilled on its own and yields its first token), then run one
decode step over every active sequence together, each at its own position. A request
joins at the next step after a slot frees; a finished one (its ``max_tokens``, a stop
string, the end-of-sequence token, or the context's end) leaves and frees its slot at once,
and so does one whose client went away. Events (text deltas, then the finish) are handed
to the request's asyncio queue on the server's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gpuflow.devices import total_memory
from gpuflow.errors import UserError
from gpuflow.serve.generate.models import cached_lm, refusal
from gpuflow.serve.generate.sampling import Sampler, SamplingParams
from gpuflow.serve.generate.text import TextStream

log = logging.getLogger("gpuflow.serve")


class CachedLM(Protocol):
    """A causal LM that decodes over a cache: what the engine needs of a model. The cache
    (``new_cache``) has ``keys`` (a tensor on the model's device) and ``nbytes()``."""

    context: int
    vocab_size: int

    def new_cache(self, slots: int) -> Any: ...
    def bytes_per_slot(self) -> int: ...
    def tokenize(self, text: str) -> list[int]: ...
    def logits(self, tokens: torch.Tensor, cache: Any, slots: torch.Tensor,
               starts: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T', V]`` of ``tokens[B, T]`` (the engine reads the last position
        only, so ``T'`` may be 1), row ``b`` being the sequence in cache slot ``slots[b]``
        whose tokens so far end at ``starts[b]``; the new tokens' keys and values are
        written into the cache."""
    def token_bytes(self, token: int) -> bytes: ...


class WaitingFull(Exception):
    """As many requests wait for a slot as the engine queues."""


@dataclass(frozen=True)
class Delta:
    text: str


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
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    slot: int | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params)
        self.stream = TextStream(self.params.stop)

    def cancel(self) -> None:
        """Leave at the next step (the client went away, or its deadline passed)."""
        self.cancelled = True

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop has closed
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineObserver(Protocol):
    def first_token(self, seconds: float) -> None: ...
    def next_token(self, seconds: float) -> None: ...
    def occupancy(self, active: int, waiting: int, slots: int) -> None: ...


class GenerationEngine:
    """Admits, steps and retires sequences in a thread of its own."""

    def __init__(self, lm: CachedLM, slots: int, max_waiting: int,
                 context: Callable[[], contextlib.AbstractContextManager[Any]],
                 eos_token: int | None = None, observer: EngineObserver | None = None) -> None:
        self.lm, self.slots, self.max_waiting = lm, slots, max_waiting
        self.eos_token, self.observer = eos_token, observer
        self._context = context
        self.cache = lm.new_cache(slots)
        self._free = list(range(slots))
        self._active: list[Generation] = []
        self._waiting: collections.deque[Generation] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="gpuflow-generate",
                                        daemon=True)

    @property
    def active(self) -> int:
        """Sequences holding a cache slot."""
        return len(self._active)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    def submit(self, prompt: list[int], params: SamplingParams) -> Generation:
        """Queue a request for a slot; raises WaitingFull. Call on the event loop."""
        generation = Generation(prompt, params, asyncio.get_running_loop())
        with self._lock:
            if len(self._waiting) >= self.max_waiting:
                raise WaitingFull
            self._waiting.append(generation)
        self._wake.set()
        return generation

    # --- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        with self._context():
            while not self._stopped:
                try:
                    self._admit()
                    if self._active:
                        self._step()
                    else:
                        self._wake.wait(0.5)
                        self._wake.clear()
                except Exception as exc:  # a failing step fails its sequences, not the server
                    self._fail_all(f"{type(exc).__name__}: {exc}")
                self._observe()

    def _admit(self) -> None:
        while self._free:
            with self._lock:
                if not self._waiting:
                    return
                generation = self._waiting.popleft()
            if generation.cancelled:
                generation.emit(Done("cancelled", len(generation.prompt), 0))
                continue
            generation.slot = min(self._free)  # low slots first, to keep them consecutive
            self._free.remove(generation.slot)
            self._active.append(generation)
            tokens = torch.tensor([generation.prompt], device=self._device)
            logits = self.lm.logits(tokens, self.cache, self._slots([generation]),
                                    torch.zeros(1, dtype=torch.long, device=self._device))
            self._advance(generation, logits[0, -1])

    @property
    def _device(self) -> torch.device:
        return self.cache.keys.device

    def _slots(self, generations: list[Generation]) -> torch.Tensor:
        return torch.tensor([g.slot for g in generations], device=self._device)

    def _step(self) -> None:
        """One decode step of every active sequence."""
        for generation in [g for g in self._active if g.cancelled]:
            self._retire(generation, "cancelled")
        if not self._active:
            return
        batch = sorted(self._active, key=lambda g: g.slot)  # consecutive slots: no copies
        last = torch.tensor([[g.generated[-1]] for g in batch], device=self._device)
        starts = torch.tensor([g.length - 1 for g in batch], device=self._device)
        logits = self.lm.logits(last, self.cache, self._slots(batch), starts)[:, -1]
        for generation, row in zip(batch, logits, strict=True):
            self._advance(generation, row)

    def _advance(self, generation: Generation, logits: torch.Tensor) -> None:
        """Choose the next token from ``logits``, send its text, retire when finished."""
        token = generation.sampler.choose(logits.float().cpu())
        now = time.monotonic()
        if self.observer is not None:
            if generation.last_token_at is None:
                self.observer.first_token(now - generation.submitted)
            else:
                self.observer.next_token(now - generation.last_token_at)
        generation.last_token_at = now
        if token == self.eos_token:
            self._retire(generation, "stop")
            return
        generation.generated.append(token)
        text = generation.stream.feed(self.lm.token_bytes(token))
        if text:
            generation.emit(Delta(text))
        if generation.stream.stopped:
            self._retire(generation, "stop")
        elif (len(generation.generated) >= generation.params.max_tokens
              or generation.length >= self.lm.context):
            self._retire(generation, "length")

    def _retire(self, generation: Generation, reason: str) -> None:
        rest = generation.stream.finish()
        if rest and reason != "cancelled":
            generation.emit(Delta(rest))
        generation.emit(Done(reason, len(generation.prompt), len(generation.generated)))
        self._active.remove(generation)
        assert generation.slot is not None
        self._free.append(generation.slot)
        generation.slot = None

    def _fail_all(self, message: str) -> None:
        for generation in list(self._active):
            generation.emit(Failed(message))
            self._active.remove(generation)
            if generation.slot is not None:
                self._free.append(generation.slot)

    def _observe(self) -> None:
        if self.observer is not None:
            self.observer.occupancy(self.active, self.waiting, self.slots)


def cache_slots(bytes_per_slot: int, budget_bytes: int, max_seqs: int) -> int:
    """Sequences the cache holds: as many as ``budget_bytes`` allows, at most ``max_seqs``."""
    slots = min(max_seqs, budget_bytes // bytes_per_slot)
    if slots < 1:
        raise UserError(
            f"The KV cache budget ({budget_bytes / 2**30:.3g} GiB) holds no sequence of this "
            f"model, which needs {bytes_per_slot / 2**20:.1f} MiB per sequence; raise "
            "--kv-cache-gib.")
    return slots


def default_cache_budget(device: torch.device) -> int:
    """Half the device's free memory, or a quarter of a CPU's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return (total_memory() or 8 << 30) // 4


def build_generator(model: torch.nn.Module, runner: Any, kv_cache_gib: float | None,
                    max_seqs: int, max_waiting: int,
                    observer: EngineObserver | None) -> GenerationEngine | None:
    """A generation engine for the served model on the runner's device and precision, or
    None for a model that does not generate text."""
    dtype = runner.policy.autocast_dtype or torch.float32
    lm = cached_lm(model, dtype)
    if lm is None:
        log.info("gpuflow serve: no /v1/completions: %s", refusal(model))
        return None
    budget = (int(kv_cache_gib * 2**30) if kv_cache_gib is not None
              else default_cache_budget(runner.device))
    slots = cache_slots(lm.bytes_per_slot(), budget, max_seqs)
    return GenerationEngine(lm, slots, max_waiting, runner.context, observer=observer)
