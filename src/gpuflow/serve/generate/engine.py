"""Continuous batching over a paged KV pool: the thread loop and its hand-off to asyncio.

A thread of its own loops: take the requests submitted since the last step into the
``Scheduler`` (``scheduler.py``: which tokens a step computes, admission by KV blocks,
chunked prefill, preemption), drop those whose client went away (their blocks freed at
once), run the step through the ``ModelRunner`` (``runner.py``: one mixed forward, or a
bucketed, compiled or CUDA-graph decode step), then take each finished chunk's next token
(``sampling.py``), or the tokens its drafts earned (speculative decoding,
``speculate.py``), and retire a sequence on its ``max_tokens``, a stop string, an
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

from gpuflow.serve.generate.paged import PagedLM, RowSpec
from gpuflow.serve.generate.requests import (
    EngineObserver,
    Event,
    Failed,
    Generation,
    Occupancy,
    StepTiming,
    WaitingFull,
)
from gpuflow.serve.generate.runner import ModelRunner
from gpuflow.serve.generate.sampling import SamplingParams, choose_tokens, on_host
from gpuflow.serve.generate.scheduler import Plan, Scheduler, Sequence
from gpuflow.serve.generate.speculate import Draft, Proposer, verified
from gpuflow.serve.generate.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger("gpuflow.serve")


class GenerationEngine:
    """Admits, steps and retires sequences in a thread of its own."""

    def __init__(self, lm: PagedLM, scheduler: Scheduler, runner: ModelRunner,
                 max_queue: int, context: Callable[[], contextlib.AbstractContextManager[Any]],
                 tokenizer: Tokenizer | None = None, eos_ids: Iterable[int] = (),
                 observer: EngineObserver | None = None,
                 proposer: Proposer | None = None) -> None:
        self.lm, self.scheduler, self.runner = lm, scheduler, runner
        self.proposer = proposer  # drafts tokens to verify (speculative decoding), or None
        self.drafted = self.accepted = 0  # drafted tokens so far, and those accepted
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
                timing: StepTiming | None = None
                try:
                    self._take_arrivals()
                    self._drop_cancelled()
                    plan = self.scheduler.schedule()
                    if plan.chunks:
                        started = time.perf_counter()
                        forward_s = self._step(plan)
                        timing = StepTiming(len(plan.chunks),
                                            sum(chunk.length for chunk in plan.chunks),
                                            forward_s, time.perf_counter() - started)
                    else:
                        self._wake.wait(0.5)
                        self._wake.clear()
                except Exception as exc:  # a failing step fails its sequences, not the server
                    failed = ([chunk.seq for chunk in plan.chunks] if plan is not None
                              else list(self.scheduler.running))
                    self._fail(failed, f"{type(exc).__name__}: {exc}")
                self._hand_over()
                self._observe(timing)

    def _take_arrivals(self) -> None:
        with self._lock:  # moved whole, so that ``waiting`` never undercounts
            for generation in self._arrivals:
                self._live[generation.seq] = generation
                self.scheduler.add(generation.seq)
            self._arrivals = []

    def _drop_cancelled(self) -> None:
        for generation in [g for g in self._live.values() if g.cancelled]:
            self._retire(generation, "cancelled")

    def _step(self, plan: Plan) -> float:
        """Run the plan's chunks (a decoding sequence's with its drafted tokens, if any),
        then take the next tokens of each that reached its end; seconds the forward took
        (the model runner's call; on a GPU, the launch of its work)."""
        drafts = self._drafts(plan)
        steps = []
        for chunk in plan.chunks:
            draft = drafts.get(chunk.seq)
            tokens = chunk.tokens if draft is None else chunk.tokens + draft.tokens
            wanted = self._live[chunk.seq].wanted(chunk) if draft is None else "all"
            steps.append((RowSpec(tokens, chunk.start, chunk.seq.table.blocks, wanted), chunk))
        steps.sort(key=lambda step: len(step[0].tokens) > 1)  # one-token rows first
        started = time.perf_counter()
        logits = self.runner.run([row for row, _ in steps])
        forward_s = time.perf_counter() - started
        self.scheduler.advance(plan)
        finished: list[tuple[Generation, torch.Tensor]] = []
        for (row, chunk), chunk_logits in zip(steps, logits, strict=True):
            generation, draft = self._live[chunk.seq], drafts.get(chunk.seq)
            if draft is not None:
                self._take_verified(generation, draft, on_host(chunk_logits))
                continue
            if row.logits == "all":
                generation.score_prompt(chunk, chunk_logits)
            if chunk.final:
                finished.append((generation, chunk_logits[-1:]))
        if self.proposer is not None:
            self.proposer.settle(plan.chunks)
        if finished:
            tokens = choose_tokens([g.sampler for g, _ in finished],
                                   torch.cat([row for _, row in finished]))
            for (generation, row), token in zip(finished, tokens, strict=True):
                self._advance(generation, token, row)
        return forward_s

    def _drafts(self, plan: Plan) -> dict[Sequence, Draft]:
        """The proposer's drafts for the step's decoding sequences, each within the room
        the scheduler reserved and the tokens its request has left to generate."""
        if self.proposer is None:
            return {}
        rooms = {}
        for chunk in plan.chunks:
            params = self._live[chunk.seq].params
            if params.seed is not None and params.temperature > 0.0:
                continue  # drafts would change its random draws, and so its seeded text
            room = min(chunk.room, params.max_tokens - len(self._live[chunk.seq].generated) - 1)
            if room > 0:
                rooms[chunk.seq] = room
        # Called on every step, drafting or not: a draft model computes every chunk.
        samplers = {seq: self._live[seq].sampler for seq in rooms}
        return self.proposer.propose(plan.chunks, rooms, samplers)

    def _take_verified(self, generation: Generation, draft: Draft,
                       logits: torch.Tensor) -> None:
        """Take the tokens one verifying forward gives ``generation`` (``logits[k + 1, V]``):
        the drafts it accepts, then one of its own; each accepted draft's keys and values,
        written by the step, count as computed (and its full blocks cached) as it is
        taken."""
        for position, token in enumerate(verified(generation.sampler, logits, draft)):
            accepted = position < len(draft.tokens) and token == draft.tokens[position]
            self.accepted += accepted
            if not self._advance(generation, token, logits[position:position + 1]):
                # Finished, its blocks released: the drafts after this one go unjudged.
                self.drafted += min(position + 1, len(draft.tokens))
                return
            if accepted:
                self.scheduler.accept(generation.seq, 1)
        self.drafted += len(draft.tokens)

    def _advance(self, generation: Generation, token: int, logits: torch.Tensor) -> bool:
        """Time the token, hand it to its request, retire the request when finished;
        whether it goes on."""
        now = time.monotonic()
        if self.observer is not None:
            if generation.last_token_at is None:
                self.observer.first_token(now - generation.submitted)
            else:
                self.observer.next_token(now - generation.last_token_at)
        generation.last_token_at = now
        events, finished = generation.take(token, logits, self.eos_ids, self.lm.context)
        self._outbox += [(generation, event) for event in events]
        if finished is not None:
            self._retire(generation, finished)
        return finished is None

    def _retire(self, generation: Generation, reason: str) -> None:
        self._outbox += [(generation, event) for event in generation.finish(reason)]
        self._forget(generation)

    def _forget(self, generation: Generation) -> None:
        self.scheduler.finish(generation.seq)
        del self._live[generation.seq]

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            generation = self._live.get(seq)
            if generation is not None:  # not retired before the step failed
                self._outbox.append((generation, Failed(message)))
                self._forget(generation)

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

    def _observe(self, timing: StepTiming | None) -> None:
        """The observer's view of the engine after a step (and of the step, if one ran), once
        its events are handed over: a failing observer is logged, and fails no sequence."""
        if self.observer is None:
            return
        blocks = self.scheduler.blocks
        try:
            if timing is not None:
                self.observer.step(timing)
            self.observer.occupancy(Occupancy(
                self.active, self.waiting, blocks.used, blocks.total,
                self.scheduler.preemptions, blocks.prefix_queries, blocks.prefix_hits,
                self.drafted, self.accepted))
        except Exception:
            log.exception("gpuflow serve: the generation engine's observer failed")


def _deliver(events: list[tuple[Generation, Event]]) -> None:
    for generation, event in events:
        generation.events.put_nowait(event)
