"""The engine core: scheduler, KV pool, model runner and sampling, stepping sequences of
token ids; no text, no event loop, nothing of HTTP.

The core knows requests by id. Between steps it takes what the server sent (``Inbox``: new
requests, ids to drop) and each step yields one ``Report``: for every request that moved,
the tokens it took this step (with their log-probabilities when asked), and its finish when
the core ended it (an end-of-sequence id, ``max_tokens``, the context's end, a drop, a
failed step). Stop strings need text, so the server ends those and drops the id; a token or
two the core computed past one is never sent on. The same core runs in the server's own
thread or in a process of its own (``link.py``): its messages are plain data that pickle.

A step: take the scheduler's plan (``scheduler.py``), run its chunks through the
``ModelRunner`` (``runner.py``: one mixed forward, or a bucketed, compiled or CUDA-graph
decode step) in the device thread (``launch.py``), then take each finished chunk's next
token (``sampling.py``), or the tokens its drafts earned (speculative decoding,
``speculate.py``); a constrained row's logits are masked by its grammar first
(``grammar.py``; one new to the core waits outside the scheduler while it compiles,
``compiling.py``), on the host; its drafts are cut to what its grammar accepts, and each
is verified under its grammar's mask at its position. A request under a LoRA adapter
waits outside the scheduler too until its adapter holds a slot (``adapter_queue.py``: read
in on first use, into an empty slot or one no live request pins), which it pins until it
ends; its rows carry the slot. A step of greedy rows is left in
flight: the next one is planned and launched before its tokens are taken, so the host's
work overlaps the forward; a constrained row never is (its mask needs its last token).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gpuflow.serve.dtypes import short_name
from gpuflow.serve.generate.adapter_queue import AdapterQueue
from gpuflow.serve.generate.compiling import GrammarQueue
from gpuflow.serve.generate.core_request import PENDING, CoreRequest
from gpuflow.serve.generate.grammar import Guide
from gpuflow.serve.generate.launch import DeviceThread, Forward, Launched, run_forward
from gpuflow.serve.generate.lora_slots import SlotTable
from gpuflow.serve.generate.messages import (
    Inbox,
    NewRequest,
    Occupancy,
    Output,
    Report,
    StepTiming,
)
from gpuflow.serve.generate.paged import RowSpec
from gpuflow.serve.generate.runner import ModelRunner
from gpuflow.serve.generate.sampling import choose_tokens, on_host
from gpuflow.serve.generate.scheduler import Plan, Scheduler, Sequence
from gpuflow.serve.generate.speculate import Draft, Proposer, verified


class EngineCore:
    """Admits, steps and retires requests of token ids; ``step`` is called in a loop."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, context: int,
                 eos_ids: Iterable[int] = (), proposer: Proposer | None = None,
                 overlap: bool = True, adapters: SlotTable | None = None) -> None:
        self.scheduler, self.runner, self.context = scheduler, runner, context
        self.adapters = AdapterQueue(adapters)  # requests waiting for their adapter's slot
        self.proposer = proposer  # drafts tokens to verify (speculative decoding), or None
        self.drafted = self.accepted = 0  # drafted tokens so far, and those accepted
        self.eos_ids = frozenset(eos_ids)
        self.taken = 0  # requests taken in so far
        self._live: dict[Sequence, CoreRequest] = {}
        self._by_id: dict[int, CoreRequest] = {}
        self._moved: dict[int, CoreRequest] = {}  # took tokens since the last report
        self._outputs: list[Output] = []  # finished since the last report
        self.overlap = overlap  # leave greedy steps in flight (launch.py)
        self._device: DeviceThread | None = None
        self._in_flight: Launched | None = None  # a step whose tokens are on the device
        self._pending: dict[Sequence, int] = {}  # its sequences: their token's index there
        self.compiling = GrammarQueue()  # constrained requests whose grammar compiles

    @property
    def idle(self) -> bool:
        return (not self._live and self._in_flight is None and not self.compiling
                and not self.adapters)

    def receive(self, inbox: Inbox) -> None:
        """New requests into the scheduler's queue (a constrained one once its grammar's
        guide is ready, one under an adapter once it holds a slot); dropped ones leave it,
        blocks freed."""
        self.adapters.receive(inbox)
        if inbox.vocabulary is not None:
            self.compiling.start(inbox.vocabulary, self.eos_ids)
        for new in inbox.new:
            if new.params.constraint is None:
                self._admit(new, None, None)
            else:
                self.compiling.submit(new)
        self._admit_compiled()
        self.taken += len(inbox.new)
        for request_id in inbox.dropped:
            if self.adapters.drop(request_id) or self.compiling.drop(request_id):
                self._outputs.append(Output(request_id, finish="cancelled"))
                continue
            request = self._by_id.get(request_id)
            if request is not None:  # not finished already
                self._retire(request, "cancelled")

    def _admit(self, new: NewRequest, guide: Guide | None, error: str | None) -> None:
        request = CoreRequest(new.id, new.prompt, new.params, guide, new.adapter)
        if new.adapter and error is None:
            self.adapters.submit(request)
            self._admit_adapted()
        else:
            self._enter(request, error)

    def _enter(self, request: CoreRequest, error: str | None = None) -> None:
        self._live[request.seq] = self._by_id[request.id] = request
        self.scheduler.add(request.seq)
        if error is not None:
            self._retire(request, "failed", error)

    def _admit_adapted(self) -> None:
        """Into the scheduler, the requests whose adapter holds a slot now."""
        for request, error in self.adapters.ready():
            self._enter(request, error)

    def _admit_compiled(self) -> None:
        """Admit the constrained requests whose grammar is compiled; with nothing else to
        do, wait a little for one."""
        if self.compiling and not self._live and self._in_flight is None:
            self.compiling.wait(0.05)
        for new, guide, error in self.compiling.ready():
            self._admit(new, guide, error)

    def start(self, context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        """Start the device thread (under ``context``) and run the decode warm-up there:
        CUDA graphs replay in the thread that recorded them."""
        self._device = DeviceThread(context)
        self._device.call(self.runner.warm_up)

    def stop(self) -> None:
        self.compiling.shutdown()
        if self._device is not None:
            self._device.shutdown()

    def step(self) -> Report | None:
        """Plan and launch a step, if any sequence has tokens to compute; take the tokens
        of the step launched before it (a step left in flight) and of this one if it is
        not left in flight; report what moved, or None when nothing happened."""
        self._admit_compiled()
        if self.adapters:
            self._admit_adapted()
        plan: Plan | None = None
        launched = None
        try:
            plan = self.scheduler.schedule()
            if plan.chunks:
                launched = self._launch(plan)
        except Exception as exc:  # a failing step fails its sequences, not the server
            self._fail([chunk.seq for chunk in plan.chunks] if plan is not None
                       else list(self._live), f"{type(exc).__name__}: {exc}")
        timings = [t for t in (self._complete_in_flight(),
                               None if launched is None else self._settle(launched))
                   if t is not None]
        if not timings and not self._outputs and not self._moved and launched is None:
            return None
        outputs, token_ids, tokens = self._outputs, [], []
        for request in self._moved.values():
            token = request.lone_token()
            if token is None:
                outputs.append(request.output())
            else:
                token_ids.append(request.id)
                tokens.append(token)
        self._outputs, self._moved = [], {}
        return Report(tuple(outputs), self.occupancy(), self.taken, tuple(timings),
                      tuple(token_ids), tuple(tokens))

    def fail_all(self, message: str) -> Report:
        """Fail every request the core holds (a step broke its own bookkeeping): their
        clients hear of it, and the core starts again empty."""
        self._in_flight = None
        self._pending.clear()
        self._fail(list(self._live), message)
        self._outputs += [Output(new.id, finish="failed", error=message)
                          for new in self.compiling.clear()]
        self._outputs += [Output(request.id, finish="failed", error=message)
                          for request in self.adapters.clear()]
        outputs, self._outputs, self._moved = self._outputs, [], {}
        return Report(tuple(outputs), self.occupancy(), self.taken)

    def limits(self) -> dict[str, object]:
        """The pool's and the scheduler's limits, for /readyz."""
        scheduler, blocks = self.scheduler, self.scheduler.blocks
        return {**self.adapters.limits(), "kv_blocks": blocks.total,
                "block_size": blocks.block_size,
                "kv_cache_bytes": self.runner.pool.nbytes(),
                "kv_cache_dtype": short_name(self.runner.pool.keys.dtype),
                "prefix_caching": blocks.prefix_caching,
                "max_num_seqs": scheduler.max_num_seqs,
                "max_num_batched_tokens": scheduler.max_num_batched_tokens}

    def occupancy(self) -> Occupancy:
        scheduler, blocks = self.scheduler, self.scheduler.blocks
        # Those compiling and those waiting for their adapter's slot wait too.
        waiting = len(scheduler.waiting) + len(self.compiling) + len(self.adapters)
        return Occupancy(len(scheduler.running), waiting, blocks.used, blocks.total,
                         scheduler.preemptions, blocks.prefix_queries, blocks.prefix_hits,
                         self.drafted, self.accepted)

    def _launch(self, plan: Plan) -> Launched:
        """Hand the plan's chunks (a decoding sequence's with its drafted tokens, if any) to
        the device thread; left in flight when every row's next token may stay there."""
        drafts, live = self._drafts(plan), self._live
        in_flight = self.overlap and self.proposer is None
        steps = []
        for chunk in plan.chunks:  # once a step per running sequence: kept lean
            seq = chunk.seq
            draft, request = drafts.get(seq), live[seq]
            in_flight = in_flight and request.device_sampled
            tokens = chunk.tokens if draft is None else chunk.tokens + draft.tokens
            wanted = request.wanted(chunk) if draft is None else "all"
            # The table as it is now: the device thread reads it after the core moves on.
            blocks = tuple(seq.table.blocks)
            steps.append((RowSpec(tokens, chunk.start, blocks, wanted, request.slot), chunk))
        steps.sort(key=lambda step: len(step[0].tokens) > 1)  # one-token rows first
        finals, patch_rows = [], []
        for i, (row, chunk) in enumerate(steps):
            if chunk.final and chunk.seq not in drafts:
                finals.append(i)
            if row.tokens[-1] == PENDING:
                patch_rows.append(i)
        source = self._in_flight.forward if self._in_flight is not None else None
        source_index = (torch.tensor([self._pending[steps[i][1].seq] for i in patch_rows])
                        if patch_rows else None)  # made here, while the device thread works
        forward = self._device_thread().submit(
            run_forward, self.runner, [row for row, _ in steps], patch_rows, source,
            source_index, finals, in_flight)
        return Launched(plan, steps, drafts, finals, in_flight, time.perf_counter(), forward)

    def _device_thread(self) -> DeviceThread:
        if self._device is None:  # a core stepped without start(): tests
            self._device = DeviceThread(contextlib.nullcontext)
        return self._device

    def _complete_in_flight(self) -> StepTiming | None:
        """Take the tokens of the step left in flight, now that the next one is launched."""
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            return None
        done = self._result(launched)
        if done is None:
            return None
        ids = [] if done.tokens is None else done.tokens.tolist()
        for index, token in zip(launched.finals, ids, strict=True):
            seq = launched.steps[index][1].seq
            self._pending.pop(seq, None)
            request = self._live.get(seq)
            if request is not None:  # not retired while in flight
                self._advance(request, token, None)
        return self._timing(launched, done)

    def _settle(self, launched: Launched) -> StepTiming | None:
        """A step launched: its keys and values count as computed; left in flight, its
        sequences hold a placeholder for their next token, else its tokens are taken."""
        live = Plan([chunk for chunk in launched.plan.chunks if chunk.seq in self._live])
        if launched.in_flight:
            self.scheduler.advance(live)
            for position, index in enumerate(launched.finals):
                request = self._live.get(launched.steps[index][1].seq)
                if request is not None and request.may_go_on(self.context):
                    request.seq.tokens.append(PENDING)
                    self._pending[request.seq] = position
            self._in_flight = launched
            return None
        self._prepare_masks(launched)
        done = self._result(launched)
        if done is None:
            return None
        self.scheduler.advance(live)
        finished: list[tuple[CoreRequest, torch.Tensor]] = []
        for (row, chunk), chunk_logits in zip(launched.steps, done.logits, strict=True):
            request, draft = self._live.get(chunk.seq), launched.drafts.get(chunk.seq)
            if request is None:
                continue  # retired when the step before it was taken
            if draft is not None:
                self._take_verified(request, draft, on_host(chunk_logits))
                continue
            if row.logits == "all":
                request.score_prompt(chunk, chunk_logits)
            if chunk.final:
                finished.append((request, chunk_logits[-1:]))
        if self.proposer is not None:
            self.proposer.settle(launched.plan.chunks)
        if finished:
            tokens = choose_tokens([r.sampler for r, _ in finished],
                                   torch.cat([row for _, row in finished]))
            for (request, row), token in zip(finished, tokens, strict=True):
                self._advance(request, token, row)
        mask_s = sum(r.guide.spent() for r, _ in finished if r.guide is not None)
        return self._timing(launched, done, mask_s)

    def _prepare_masks(self, launched: Launched) -> None:
        """The next token's mask of each constrained row that takes one, computed while
        the step's forward runs in the device thread."""
        for index in launched.finals:
            request = self._live.get(launched.steps[index][1].seq)
            if request is not None and request.guide is not None:
                request.guide.prepare()

    def _result(self, launched: Launched) -> Forward | None:
        """The step's forward, waited for; None, its sequences failed, if it raised."""
        try:
            return launched.forward.result()
        except Exception as exc:
            self._fail([chunk.seq for chunk in launched.plan.chunks],
                       f"{type(exc).__name__}: {exc}")
            return None

    @staticmethod
    def _timing(launched: Launched, done: Forward, mask_s: float = 0.0) -> StepTiming:
        chunks = launched.plan.chunks
        return StepTiming(len(chunks), sum(chunk.length for chunk in chunks), done.forward_s,
                          time.perf_counter() - launched.started, done.graphed, mask_s)

    def _drafts(self, plan: Plan) -> dict[Sequence, Draft]:
        """The proposer's drafts for the step's decoding sequences, each within the room
        the scheduler reserved and the tokens its request has left to generate."""
        if self.proposer is None:
            return {}
        rooms = {}
        for chunk in plan.chunks:
            request = self._live[chunk.seq]
            params = request.params
            if params.seed is not None and params.temperature > 0.0:
                continue  # drafts would change its random draws, and so its seeded text
            room = min(chunk.room, params.max_tokens - len(request.generated) - 1)
            if room > 0:
                rooms[chunk.seq] = room
        # Called on every step, drafting or not: a draft model computes every chunk.
        samplers = {seq: self._live[seq].sampler for seq in rooms}
        drafts = self.proposer.propose(plan.chunks, rooms, samplers)
        for seq, draft in list(drafts.items()):
            guide = self._live[seq].guide
            if guide is not None:  # a draft its grammar refuses could never be accepted
                kept = guide.accepted(draft.tokens)
                if kept < len(draft.tokens):
                    drafts[seq] = Draft(draft.tokens[:kept], None if draft.probs is None
                                        else draft.probs[:kept])
                if not kept:
                    del drafts[seq]
        return drafts

    def _take_verified(self, request: CoreRequest, draft: Draft,
                       logits: torch.Tensor) -> None:
        """Take the tokens one verifying forward gives ``request`` (``logits[k + 1, V]``):
        the drafts it accepts, then one of its own; each accepted draft's keys and values,
        written by the step, count as computed (and its full blocks cached) as it is
        taken."""
        for position, token in enumerate(verified(request.sampler, logits, draft)):
            accepted = position < len(draft.tokens) and token == draft.tokens[position]
            self.accepted += accepted
            if not self._advance(request, token, logits[position:position + 1]):
                # Finished, its blocks released: the drafts after this one go unjudged.
                self.drafted += min(position + 1, len(draft.tokens))
                return
            if accepted:
                self.scheduler.accept(request.seq, 1)
        self.drafted += len(draft.tokens)

    def _advance(self, request: CoreRequest, token: int,
                 logits: torch.Tensor | None) -> bool:
        """Take the token, retire the request when finished; whether it goes on."""
        finished = request.take(token, logits, self.eos_ids, self.context)
        if finished is not None:
            self._retire(request, finished)
            return False
        self._moved[request.id] = request
        return True

    def _retire(self, request: CoreRequest, reason: str, error: str | None = None) -> None:
        self._moved.pop(request.id, None)
        self._pending.pop(request.seq, None)
        self._outputs.append(request.output(reason, error))
        self.scheduler.finish(request.seq)
        del self._live[request.seq], self._by_id[request.id]
        self.adapters.release(request)

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            request = self._live.get(seq)
            if request is not None:  # not retired before the step failed
                self._retire(request, "failed", message)
