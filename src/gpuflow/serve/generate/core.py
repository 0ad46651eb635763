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
decode step), then take each finished chunk's next token (``sampling.py``), or the tokens
its drafts earned (speculative decoding, ``speculate.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from gpuflow.serve.dtypes import short_name
from gpuflow.serve.generate.messages import Inbox, Occupancy, Output, Report, StepTiming
from gpuflow.serve.generate.paged import RowSpec, Wanted
from gpuflow.serve.generate.runner import ModelRunner
from gpuflow.serve.generate.sampling import (
    Sampler,
    SamplingParams,
    TokenLogprob,
    choose_tokens,
    on_host,
    token_logprobs,
)
from gpuflow.serve.generate.scheduler import Chunk, Plan, Scheduler, Sequence
from gpuflow.serve.generate.speculate import Draft, Proposer, verified


@dataclass(eq=False)
class CoreRequest:
    """One request in the core: its sequence in the scheduler, its sampler, what it
    generated, and what it took since the last report (a request that wants its prompt's
    log-probabilities computes its whole prompt itself, so that they are exact)."""

    id: int
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    # The prompt's log-probabilities (None for its first token), gathered chunk by chunk.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    reported: bool = False  # its first output is out
    new_tokens: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seq = Sequence.of(self.prompt, reuse_prefix=self.params.prompt_logprobs is None)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.sampler = Sampler(self.params, self.prompt)

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
             context: int) -> str | None:
        """Take ``token`` as the sequence's next (``logits``, ``[1, V]``, the model's at its
        position, read only for log-probabilities); why the request is finished, or None."""
        params = self.params
        if token in eos_ids and not params.ignore_eos:
            return "stop"
        self.generated.append(token)
        self.seq.tokens.append(token)
        self.sampler.observe(token)
        self.new_tokens.append(token)
        if params.logprobs is not None:
            self.new_logprobs += token_logprobs(logits, [token], params.logprobs)
        if len(self.generated) >= params.max_tokens or self.length >= context:
            return "length"
        return None

    def output(self, finish: str | None = None, error: str | None = None) -> Output:
        """What it took since the last report, and its finish; the first carries the
        prompt's log-probabilities and cached tokens."""
        first = not self.reported
        self.reported = True
        out = Output(self.id, tuple(self.new_tokens), tuple(self.new_logprobs), finish, error,
                     tuple(self.prompt_logprobs) if first and self.prompt_logprobs else None,
                     self.seq.cached_tokens if first else 0)
        self.new_tokens, self.new_logprobs = [], []
        return out


class EngineCore:
    """Admits, steps and retires requests of token ids; ``step`` is called in a loop."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, context: int,
                 eos_ids: Iterable[int] = (), proposer: Proposer | None = None) -> None:
        self.scheduler, self.runner, self.context = scheduler, runner, context
        self.proposer = proposer  # drafts tokens to verify (speculative decoding), or None
        self.drafted = self.accepted = 0  # drafted tokens so far, and those accepted
        self.eos_ids = frozenset(eos_ids)
        self.taken = 0  # requests taken in so far
        self._live: dict[Sequence, CoreRequest] = {}
        self._by_id: dict[int, CoreRequest] = {}
        self._moved: dict[int, CoreRequest] = {}  # took tokens since the last report
        self._outputs: list[Output] = []  # finished since the last report

    @property
    def idle(self) -> bool:
        return not self._live

    def receive(self, inbox: Inbox) -> None:
        """New requests into the scheduler's queue; dropped ones leave it, blocks freed."""
        for new in inbox.new:
            request = CoreRequest(new.id, new.prompt, new.params)
            self._live[request.seq] = self._by_id[new.id] = request
            self.scheduler.add(request.seq)
        self.taken += len(inbox.new)
        for request_id in inbox.dropped:
            request = self._by_id.get(request_id)
            if request is not None:  # not finished already
                self._retire(request, "cancelled")

    def step(self) -> Report | None:
        """One step, if any sequence has tokens to compute, and what it produced; the
        report of the drops alone when none has; None when nothing happened."""
        plan: Plan | None = None
        timing = None
        try:
            plan = self.scheduler.schedule()
            if plan.chunks:
                started = time.perf_counter()
                forward_s = self._step(plan)
                timing = StepTiming(len(plan.chunks), sum(c.length for c in plan.chunks),
                                    forward_s, time.perf_counter() - started,
                                    self.runner.graphed)
        except Exception as exc:  # a failing step fails its sequences, not the server
            self._fail([chunk.seq for chunk in plan.chunks] if plan is not None
                       else list(self._live), f"{type(exc).__name__}: {exc}")
        if timing is None and not self._outputs and not self._moved:
            return None
        outputs = [*self._outputs, *(r.output() for r in self._moved.values())]
        self._outputs, self._moved = [], {}
        return Report(tuple(outputs), self.occupancy(), self.taken, timing)

    def limits(self) -> dict[str, object]:
        """The pool's and the scheduler's limits, for /readyz."""
        scheduler, blocks = self.scheduler, self.scheduler.blocks
        return {"kv_blocks": blocks.total, "block_size": blocks.block_size,
                "kv_cache_bytes": self.runner.pool.nbytes(),
                "kv_cache_dtype": short_name(self.runner.pool.keys.dtype),
                "prefix_caching": blocks.prefix_caching,
                "max_num_seqs": scheduler.max_num_seqs,
                "max_num_batched_tokens": scheduler.max_num_batched_tokens}

    def occupancy(self) -> Occupancy:
        scheduler, blocks = self.scheduler, self.scheduler.blocks
        return Occupancy(len(scheduler.running), len(scheduler.waiting), blocks.used,
                         blocks.total, scheduler.preemptions, blocks.prefix_queries,
                         blocks.prefix_hits, self.drafted, self.accepted)

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
        finished: list[tuple[CoreRequest, torch.Tensor]] = []
        for (row, chunk), chunk_logits in zip(steps, logits, strict=True):
            request, draft = self._live[chunk.seq], drafts.get(chunk.seq)
            if draft is not None:
                self._take_verified(request, draft, on_host(chunk_logits))
                continue
            if row.logits == "all":
                request.score_prompt(chunk, chunk_logits)
            if chunk.final:
                finished.append((request, chunk_logits[-1:]))
        if self.proposer is not None:
            self.proposer.settle(plan.chunks)
        if finished:
            tokens = choose_tokens([r.sampler for r, _ in finished],
                                   torch.cat([row for _, row in finished]))
            for (request, row), token in zip(finished, tokens, strict=True):
                self._advance(request, token, row)
        return forward_s

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
        return self.proposer.propose(plan.chunks, rooms, samplers)

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

    def _advance(self, request: CoreRequest, token: int, logits: torch.Tensor) -> bool:
        """Take the token, retire the request when finished; whether it goes on."""
        finished = request.take(token, logits, self.eos_ids, self.context)
        if finished is not None:
            self._retire(request, finished)
            return False
        self._moved[request.id] = request
        return True

    def _retire(self, request: CoreRequest, reason: str, error: str | None = None) -> None:
        self._moved.pop(request.id, None)
        self._outputs.append(request.output(reason, error))
        self.scheduler.finish(request.seq)
        del self._live[request.seq], self._by_id[request.id]

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            request = self._live.get(seq)
            if request is not None:  # not retired before the step failed
                self._retire(request, "failed", message)
