"""Continuous batching over a KV cache allocated once.

The engine owns ``slots`` cache rows and a thread that loops: admit waiting requests into
free slots (their prompts prefilled together, right-padded, each giving its first token),
then run one decode step over every active sequence together, each at its own position.
A request joins at the next step after a slot frees; a finished one (its ``max_tokens``, a
stop string, an end-of-sequence id, or the context's end) leaves and frees its slot at
once, and so does one whose client went away. Events (text deltas with the tokens'
log-probabilities when asked, then the finish) are handed to the requests' asyncio queues
on the server's event loop, all of a step's at once: one wake-up of the loop a step, not
one a sequence. How the model runs (eagerly, over batch buckets, compiled, as CUDA graphs)
is the ``DecodeRunner``'s (``runner.py``); the engine thread runs every bucket before it
serves (``wait_warm``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from gpuflow.serve.generate.budget import cache_slots, default_cache_budget
from gpuflow.serve.generate.models import cached_lm, refusal
from gpuflow.serve.generate.requests import (
    Delta,
    Done,
    EngineObserver,
    Event,
    Failed,
    Generation,
    WaitingFull,
)
from gpuflow.serve.generate.runner import DecodeRunner
from gpuflow.serve.generate.sampling import (
    SamplingParams,
    choose_tokens,
    token_logprobs,
)
from gpuflow.serve.generate.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger("gpuflow.serve")
PREFILL_TOKENS = 4096  # padded prompt tokens one prefill forward takes, beyond a lone prompt


class CachedLM(Protocol):
    """A causal LM that decodes over a cache: what the engine needs of a model. The cache
    (``new_cache``) has ``keys`` (a tensor on the model's device) and ``nbytes()``.
    ``vocab_size`` is the number of logits the engine chooses among."""

    context: int
    vocab_size: int

    def new_cache(self, slots: int) -> Any: ...
    def bytes_per_slot(self) -> int: ...
    def logits(self, tokens: torch.Tensor, cache: Any, slots: torch.Tensor,
               starts: torch.Tensor, lengths: torch.Tensor | None = None,
               all_positions: bool = False) -> torch.Tensor:
        """Logits ``[B, V]`` of each row's last token of ``tokens[B, T]`` (token
        ``lengths[b] - 1`` of a right-padded batch; default the last), or ``[B, T, V]`` of
        every position with ``all_positions``; row ``b`` is the sequence in cache slot
        ``slots[b]`` whose tokens so far end at ``starts[b]``. The new tokens' keys and
        values are written into the cache (a padded row's padding too, past its end, where
        its next tokens overwrite them before any step can see them)."""
    def step(self, tokens: torch.Tensor, cache: Any, slots: torch.Tensor,
             starts: torch.Tensor) -> torch.Tensor:
        """``logits`` of one new token per row (``tokens[B, 1]``), ``[B, V]``, in shapes
        that depend on ``B`` alone and without waiting for the device: what
        ``torch.compile(dynamic=False)`` and CUDA graphs need."""
    def written(self, cache: Any) -> list[torch.Tensor]:
        """The cache tensors ``step`` writes into."""


class GenerationEngine:
    """Admits, steps and retires sequences in a thread of its own."""

    def __init__(self, lm: CachedLM, slots: int, max_waiting: int,
                 context: Callable[[], contextlib.AbstractContextManager[Any]],
                 tokenizer: Tokenizer | None = None, eos_ids: Iterable[int] = (),
                 observer: EngineObserver | None = None, bucketed: bool = False,
                 compile: bool = False, cuda_graphs: bool = False) -> None:
        self.lm, self.slots, self.max_waiting = lm, slots, max_waiting
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.eos_ids, self.observer = frozenset(eos_ids), observer
        self._context = context
        self.runner = DecodeRunner(lm, slots, bucketed, compile, cuda_graphs)
        self._warm = threading.Event()
        self._warm_error: BaseException | None = None
        self._free = list(range(slots))
        self._active: list[Generation] = []
        self._waiting: collections.deque[Generation] = collections.deque()
        self._outbox: list[tuple[Generation, Event]] = []  # events not yet handed over
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

    @property
    def cache(self) -> Any:
        return self.runner.cache

    @property
    def warmup_s(self) -> float | None:
        """Seconds the decode warm-up took, once done."""
        return self.runner.warmup_s

    def describe(self) -> str:
        """How decode steps run, e.g. ``decode compiled for batch buckets 1,2,4``."""
        return self.runner.describe()

    def start(self) -> None:
        self._thread.start()

    def wait_warm(self, timeout: float | None = None) -> float:
        """Wait until the engine thread has run every bucket's decode step once (compiling
        each, recording its CUDA graph); seconds it took. Raises what the warm-up raised,
        and returns early on ``stop()`` (a server shutting down does not wait for it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._warm.wait(0.1):
            if self._stopped:
                raise RuntimeError("the generation engine stopped while warming up")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the generation engine is still warming up")
        if self._warm_error is not None:
            raise self._warm_error
        assert self.warmup_s is not None
        return self.warmup_s

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    def submit(self, prompt: list[int], params: SamplingParams) -> Generation:
        """Queue a request for a slot; raises WaitingFull. Call on the event loop."""
        generation = Generation(prompt, params, asyncio.get_running_loop(),
                                self.tokenizer.detokenizer(prompt))
        with self._lock:
            if len(self._waiting) >= self.max_waiting:
                raise WaitingFull
            self._waiting.append(generation)
        self._wake.set()
        return generation

    # --- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        with self._context():
            try:
                self.runner.warm_up()
            except BaseException as exc:
                self._warm_error = exc
                log.exception("gpuflow serve: the decode warm-up failed")
                return
            finally:
                self._warm.set()
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
                self._hand_over()
                self._observe()

    def _admit(self) -> None:
        """Give waiting requests free slots and prefill them: together in one forward, as
        many as ``PREFILL_TOKENS`` padded tokens hold (a burst of arrivals waits for one
        prefill, not one each); one asking for its prompt's log-probabilities alone."""
        batch: list[Generation] = []
        while self._free:
            with self._lock:
                if not self._waiting:
                    break
                generation = self._waiting[0]
                longest = max([len(generation.prompt), *(len(g.prompt) for g in batch)])
                if batch and longest * (len(batch) + 1) > PREFILL_TOKENS:
                    break
                self._waiting.popleft()
            if generation.cancelled:
                self._emit(generation, Done("cancelled", len(generation.prompt), 0))
                continue
            generation.slot = min(self._free)  # low slots first, to keep them consecutive
            self._free.remove(generation.slot)
            self._active.append(generation)
            if generation.params.prompt_logprobs is not None:
                self._prefill_scored(generation)
            else:
                batch.append(generation)
        if batch:
            self._prefill(batch)
        self._hand_over()  # first tokens go out now, not after the decode step

    def _prefill(self, batch: list[Generation]) -> None:
        """Run the prompts, right-padded, into their slots and take each first token."""
        logits = self.runner.prefill([g.prompt for g in batch], _slots(batch))
        for row, (generation, token) in enumerate(zip(
                batch, choose_tokens([g.sampler for g in batch], logits), strict=True)):
            self._advance(generation, token, logits[row:row + 1])

    def _prefill_scored(self, generation: Generation) -> None:
        """Prefill one prompt and keep its tokens' log-probabilities from the same forward."""
        prompt = generation.prompt
        rows = self.runner.prefill([prompt], _slots([generation]), all_positions=True)[0]
        generation.prompt_logprobs = [None, *token_logprobs(
            rows[:-1], prompt[1:], generation.params.prompt_logprobs or 0)]
        self._advance(generation, generation.sampler.choose(rows[-1]), rows[-1:])

    def _step(self) -> None:
        """One decode step of every active sequence."""
        for generation in [g for g in self._active if g.cancelled]:
            self._retire(generation, "cancelled")
        if not self._active:
            return
        batch = sorted(self._active, key=lambda g: g.slot)  # consecutive slots: no copies
        logits = self.runner.decode([g.generated[-1] for g in batch], _slots(batch),
                                    [g.length - 1 for g in batch])
        tokens = choose_tokens([g.sampler for g in batch], logits)
        for row, (generation, token) in enumerate(zip(batch, tokens, strict=True)):
            self._advance(generation, token, logits[row:row + 1])

    def _advance(self, generation: Generation, token: int, logits: torch.Tensor) -> None:
        """Take ``token`` as the sequence's next, send its text, retire when finished.
        ``logits`` (``[1, V]``, on the CPU) are the model's at the token's position."""
        now = time.monotonic()
        if self.observer is not None:
            if generation.last_token_at is None:
                self.observer.first_token(now - generation.submitted)
            else:
                self.observer.next_token(now - generation.last_token_at)
        generation.last_token_at = now
        params = generation.params
        if token in self.eos_ids and not params.ignore_eos:
            self._retire(generation, "stop")
            return
        generation.generated.append(token)
        generation.sampler.observe(token)
        if params.logprobs is not None:
            generation.unsent_logprobs += token_logprobs(logits, [token], params.logprobs)
        text = generation.stream.feed(generation.detokenizer.add(token))
        if text:
            self._emit(generation, self._delta(generation, text))
        if generation.stream.stopped:
            self._retire(generation, "stop")
        elif (len(generation.generated) >= generation.params.max_tokens
              or generation.length >= self.lm.context):
            self._retire(generation, "length")

    @staticmethod
    def _delta(generation: Generation, text: str) -> Delta:
        """``text`` with the log-probabilities of the tokens taken since the last delta."""
        logprobs = tuple(generation.unsent_logprobs)
        generation.unsent_logprobs.clear()
        return Delta(text, logprobs)

    def _retire(self, generation: Generation, reason: str) -> None:
        rest = generation.stream.finish(generation.detokenizer.finish())
        if (rest or generation.unsent_logprobs) and reason != "cancelled":
            self._emit(generation, self._delta(generation, rest))
        self._emit(generation, Done(reason, len(generation.prompt), len(generation.generated)))
        self._active.remove(generation)
        assert generation.slot is not None
        self._free.append(generation.slot)
        generation.slot = None

    def _fail_all(self, message: str) -> None:
        for generation in list(self._active):
            self._emit(generation, Failed(message))
            self._active.remove(generation)
            if generation.slot is not None:
                self._free.append(generation.slot)

    def _emit(self, generation: Generation, event: Event) -> None:
        self._outbox.append((generation, event))

    def _hand_over(self) -> None:
        """Put the events emitted since the last call into their requests' queues, with
        one call into each event loop (there is one: the server's)."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Generation, Event]]] = {}
        for generation, event in self._outbox:
            by_loop.setdefault(generation.loop, []).append((generation, event))
        self._outbox = []
        for loop, events in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the event loop has closed
                loop.call_soon_threadsafe(_deliver, events)

    def _observe(self) -> None:
        if self.observer is not None:
            self.observer.occupancy(self.active, self.waiting, self.slots)


def _slots(generations: list[Generation]) -> list[int]:
    slots = [g.slot for g in generations]
    assert None not in slots
    return slots  # type: ignore[return-value]


def _deliver(events: list[tuple[Generation, Event]]) -> None:
    for generation, event in events:
        generation.events.put_nowait(event)


def build_generator(model: torch.nn.Module, runner: Any, kv_cache_gib: float | None,
                    max_seqs: int, max_waiting: int, observer: EngineObserver | None,
                    tokenizer: Tokenizer | None = None, eos_ids: Iterable[int] = (),
                    context: int | None = None) -> GenerationEngine | None:
    """A generation engine for the served model on the runner's device and precision, its
    decode steps compiled (and on CUDA replayed as graphs) when the runner's model is, or
    None for a model that does not generate text. ``tokenizer`` (default: bytes) and
    ``eos_ids`` are the model's; ``context`` caps its sequences' length."""
    dtype = runner.policy.autocast_dtype or torch.float32
    lm = cached_lm(model, dtype, tokenizer is not None, context)
    if lm is None:
        log.info("gpuflow serve: no /v1/completions: %s", refusal(model, tokenizer is not None))
        return None
    budget = (int(kv_cache_gib * 2**30) if kv_cache_gib is not None
              else default_cache_budget(runner.device))
    slots = cache_slots(lm.bytes_per_slot(), budget, max_seqs, spare=int(runner.compiled))
    return GenerationEngine(lm, slots, max_waiting, runner.context, tokenizer=tokenizer,
                            eos_ids=eos_ids, observer=observer, compile=runner.compiled,
                            cuda_graphs=runner.cuda_graphs)
