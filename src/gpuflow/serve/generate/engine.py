"""Continuous batching over a paged KV pool: the thread loop and its hand-off to asyncio.

A thread of its own loops: take the requests submitted since the last step into the
``Scheduler`` (``scheduler.py``: which tokens a step computes, admission by KV blocks,
chunked prefill, preemption), drop those whose client went away (their blocks freed at
once), run the step through the ``ModelRunner`` (``runner.py``: one mixed forward, or a
bucketed, compiled or CUDA-graph decode step), then take each finished chunk's next token
(``sampling.py``) and retire a sequence on its ``max_tokens``, a stop string, an
end-of-sequence id, or the context's end. Events (text deltas with the tokens'
log-probabilities when asked, then the finish) are handed to the requests' asyncio queues
on the server's event loop, all of a step's at once: one wake-up of the loop a step, not
one a sequence. The thread runs every decode bucket before it serves (``wait_warm``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gpuflow.serve.generate.blocks import BlockManager
from gpuflow.serve.generate.budget import default_cache_budget, pool_blocks
from gpuflow.serve.generate.limits import EngineLimits
from gpuflow.serve.generate.models import paged_lm, refusal
from gpuflow.serve.generate.paged import PagedLM, RowSpec, Wanted
from gpuflow.serve.generate.requests import (
    Delta,
    Done,
    EngineObserver,
    Event,
    Failed,
    Generation,
    Occupancy,
    WaitingFull,
)
from gpuflow.serve.generate.runner import ModelRunner
from gpuflow.serve.generate.sampling import SamplingParams, choose_tokens, token_logprobs
from gpuflow.serve.generate.scheduler import Chunk, Plan, Scheduler, Sequence
from gpuflow.serve.generate.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger("gpuflow.serve")


class GenerationEngine:
    """Admits, steps and retires sequences in a thread of its own."""

    def __init__(self, lm: PagedLM, scheduler: Scheduler, runner: ModelRunner,
                 max_queue: int, context: Callable[[], contextlib.AbstractContextManager[Any]],
                 tokenizer: Tokenizer | None = None, eos_ids: Iterable[int] = (),
                 observer: EngineObserver | None = None) -> None:
        self.lm, self.scheduler, self.runner = lm, scheduler, runner
        self.max_queue = max_queue
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.eos_ids, self.observer = frozenset(eos_ids), observer
        self._context = context
        self._warm = threading.Event()
        self._warm_error: BaseException | None = None
        self._arrivals: list[Generation] = []  # submitted, not yet in the scheduler
        self._live: dict[Sequence, Generation] = {}  # each scheduled sequence's request
        self._outbox: list[tuple[Generation, Event]] = []  # events not yet handed over
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="gpuflow-generate",
                                        daemon=True)

    @property
    def active(self) -> int:
        """Sequences holding KV blocks."""
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        """Requests waiting to start (or, preempted, to start again)."""
        return len(self._arrivals) + len(self.scheduler.waiting)

    @property
    def warmup_s(self) -> float | None:
        """Seconds the decode warm-up took, once done."""
        return self.runner.warmup_s

    def describe(self) -> str:
        """How decode steps run, e.g. ``decode compiled for batch buckets 1,2,4``."""
        return self.runner.describe()

    def limits(self) -> dict[str, Any]:
        """The pool and the scheduler's limits, for /readyz."""
        blocks, scheduler = self.scheduler.blocks, self.scheduler
        return {"kv_blocks": blocks.total, "block_size": blocks.block_size,
                "kv_cache_bytes": self.runner.pool.nbytes(),
                "prefix_caching": blocks.prefix_caching,
                "max_num_seqs": scheduler.max_num_seqs,
                "max_num_batched_tokens": scheduler.max_num_batched_tokens}

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
        """Queue a request; raises WaitingFull past ``max_queue`` waiting. Call on the
        event loop."""
        generation = Generation(prompt, params, asyncio.get_running_loop(),
                                self.tokenizer.detokenizer(prompt))
        with self._lock:
            if self.waiting >= self.max_queue:
                raise WaitingFull
            self._arrivals.append(generation)
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
                plan: Plan | None = None
                try:
                    self._take_arrivals()
                    self._drop_cancelled()
                    plan = self.scheduler.schedule()
                    if plan.chunks:
                        self._step(plan)
                    else:
                        self._wake.wait(0.5)
                        self._wake.clear()
                except Exception as exc:  # a failing step fails its sequences, not the server
                    failed = ([chunk.seq for chunk in plan.chunks] if plan is not None
                              else list(self.scheduler.running))
                    self._fail(failed, f"{type(exc).__name__}: {exc}")
                self._hand_over()
                self._observe()

    def _take_arrivals(self) -> None:
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
        for generation in arrivals:
            self._live[generation.seq] = generation
            self.scheduler.add(generation.seq)

    def _drop_cancelled(self) -> None:
        for generation in [g for g in self._live.values() if g.cancelled]:
            self._retire(generation, "cancelled")

    def _step(self, plan: Plan) -> None:
        """Run the plan's chunks, then take the next token of each that reached its end."""
        rows = [RowSpec(chunk.tokens, chunk.start, chunk.seq.table.blocks,
                        self._wanted(chunk)) for chunk in plan.chunks]
        logits = self.runner.run(rows)
        self.scheduler.advance(plan)
        finished: list[tuple[Generation, torch.Tensor]] = []
        for row, chunk, chunk_logits in zip(rows, plan.chunks, logits, strict=True):
            generation = self._live[chunk.seq]
            if row.logits == "all":
                self._score_prompt(generation, chunk, chunk_logits)
            if chunk.final:
                finished.append((generation, chunk_logits[-1:]))
        if not finished:
            return
        tokens = choose_tokens([g.sampler for g, _ in finished],
                               torch.cat([row for _, row in finished]))
        for (generation, row), token in zip(finished, tokens, strict=True):
            self._advance(generation, token, row)

    def _wanted(self, chunk: Chunk) -> Wanted:
        """Every position's logits while the chunk holds prompt tokens whose
        log-probabilities are still wanted; else the last one's if it ends the sequence."""
        generation = self._live[chunk.seq]
        scored = generation.prompt_logprobs
        if scored is not None and chunk.start + chunk.length > len(scored) - 1 \
                and len(scored) < len(generation.prompt):
            return "all"
        return "last" if chunk.final else "none"

    def _score_prompt(self, generation: Generation, chunk: Chunk,
                      logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens the chunk's logits predict and that
        are not scored yet (a preempted sequence recomputes chunks already scored)."""
        scored = generation.prompt_logprobs
        assert scored is not None
        first = max(chunk.start, len(scored) - 1)
        end = min(chunk.start + chunk.length, len(generation.prompt) - 1)
        if end > first:
            scored += token_logprobs(logits[first - chunk.start:end - chunk.start],
                                     generation.prompt[first + 1:end + 1],
                                     generation.params.prompt_logprobs or 0)

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
        generation.seq.tokens.append(token)
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
        self._emit(generation, Done(reason, len(generation.prompt), len(generation.generated),
                                    generation.seq.cached_tokens))
        self._forget(generation)

    def _forget(self, generation: Generation) -> None:
        self.scheduler.finish(generation.seq)
        del self._live[generation.seq]

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            generation = self._live.get(seq)
            if generation is not None:  # not retired before the step failed
                self._emit(generation, Failed(message))
                self._forget(generation)

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
            blocks = self.scheduler.blocks
            self.observer.occupancy(Occupancy(
                self.active, self.waiting, blocks.used, blocks.total,
                self.scheduler.preemptions, blocks.prefix_queries, blocks.prefix_hits))


def _deliver(events: list[tuple[Generation, Event]]) -> None:
    for generation, event in events:
        generation.events.put_nowait(event)


def build_engine(lm: PagedLM, num_blocks: int, limits: EngineLimits,
                 context: Callable[[], contextlib.AbstractContextManager[Any]],
                 bucketed: bool = False, compile: bool = False, cuda_graphs: bool = False,
                 **options: Any) -> GenerationEngine:
    """An engine over a pool of ``num_blocks`` blocks (the null block among them);
    ``options`` are the engine's own (tokenizer, eos_ids, observer). Without chunked
    prefill a step's budget covers a whole context, and always a decode token of every
    sequence."""
    tokens = limits.max_num_batched_tokens
    if not limits.chunked_prefill:
        tokens = max(tokens, lm.context)
    blocks = BlockManager(num_blocks, limits.block_size, limits.prefix_caching)
    scheduler = Scheduler(blocks, limits.max_num_seqs, max(tokens, limits.max_num_seqs),
                          limits.chunked_prefill)
    runner = ModelRunner(lm, num_blocks, limits.block_size, limits.max_num_seqs, bucketed,
                         compile, cuda_graphs)
    return GenerationEngine(lm, scheduler, runner, limits.max_queue, context, **options)


def build_generator(model: torch.nn.Module, runner: Any, limits: EngineLimits,
                    observer: EngineObserver | None, tokenizer: Tokenizer | None = None,
                    eos_ids: Iterable[int] = (),
                    context: int | None = None) -> GenerationEngine | None:
    """A generation engine for the served model on the runner's device and precision, its
    decode steps compiled (and on CUDA replayed as graphs) when the runner's model is, or
    None for a model that does not generate text. ``tokenizer`` (default: bytes) and
    ``eos_ids`` are the model's; ``context`` caps its sequences' length."""
    dtype = runner.policy.autocast_dtype or torch.float32
    lm = paged_lm(model, dtype, tokenizer is not None, context)
    if lm is None:
        log.info("gpuflow serve: no /v1/completions: %s", refusal(model, tokenizer is not None))
        return None
    budget = (int(limits.kv_cache_gib * 2**30) if limits.kv_cache_gib is not None
              else default_cache_budget(runner.device))
    blocks = pool_blocks(lm.bytes_per_block(limits.block_size), budget, limits.block_size,
                         lm.context, limits.max_num_seqs)
    return build_engine(lm, blocks, limits, runner.context, compile=runner.compiled,
                        cuda_graphs=runner.cuda_graphs, tokenizer=tokenizer,
                        eos_ids=eos_ids, observer=observer)
