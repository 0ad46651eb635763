"""Which tokens each engine step computes: a state machine over sequences that knows no
model, only the block pool and two budgets.

A step first gives every running sequence that decodes its one token (a new block when it
crosses a block boundary; when the pool has none, the newest running sequence not yet in
the step is preempted: its blocks freed, itself put back at the front of the waiting queue
to be recomputed from its prompt and what it generated). Then, within what is left of
``max_num_batched_tokens``, it gives chunks to sequences still prefilling, oldest first,
and admits waiting sequences in arrival order while the pool has their chunk's blocks and
fewer than ``max_num_seqs`` run: a long prompt is prefilled over several steps, and only
its last chunk yields logits. Admission stops at the first sequence that does not fit, so
none is overtaken for ever (first come, first served).

With speculative decoding (``lookahead`` > 0), once every token above is planned, each
decoding sequence's chunk gets room for up to ``lookahead`` drafted tokens after its own
(``Chunk.room``) out of the budget and free blocks left, within the context; ``accept``
then counts the drafted tokens the model accepted as computed, their keys and values
already in the pool.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field

from gpuflow.serve.generate.blocks import ROOT_KEY, BlockManager, BlockTable


@dataclass(eq=False)
class Sequence:
    """One request's tokens (its prompt, then what it generated) and how many of them have
    their keys and values in the pool. ``reuse_prefix`` False (a request that wants its
    prompt's log-probabilities) computes every token itself. ``cached_tokens``: prompt
    tokens its first admission found cached. ``root``: the key its cached blocks chain
    from (a LoRA adapter's own, ``blocks.py``)."""

    tokens: list[int]
    prompt_len: int
    reuse_prefix: bool = True
    root: bytes = ROOT_KEY
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    cached_tokens: int = 0
    admitted: bool = False

    @classmethod
    def of(cls, prompt: list[int], reuse_prefix: bool = True, root: bytes = ROOT_KEY
           ) -> Sequence:
        return cls(list(prompt), len(prompt), reuse_prefix, root)

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass(slots=True)
class Chunk:
    """Tokens ``start`` to ``start + length`` of ``seq``, computed in one step. ``final``:
    they reach the sequence's last token, whose logits choose its next. ``room``: drafted
    tokens the step may verify after them (blocks and budget reserved). Not changed once
    made, but not frozen: one is made a step per running sequence, and a frozen
    dataclass's ``__init__`` costs three times as much."""

    seq: Sequence
    start: int
    length: int
    room: int = 0

    @property
    def final(self) -> bool:
        return self.start + self.length == len(self.seq.tokens)

    @property
    def tokens(self) -> list[int]:
        return self.seq.tokens[self.start:self.start + self.length]


@dataclass(frozen=True)
class Plan:
    """One step: the decode chunks (one token each) first, then prefill chunks."""

    chunks: list[Chunk]


class Scheduler:
    """Running and waiting sequences over a ``BlockManager``."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, lookahead: int = 0,
                 context: int | None = None) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must cover one decode token of each of "
                             "max_num_seqs sequences")
        if lookahead and context is None:
            raise ValueError("drafted tokens need the context they must stay within")
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.lookahead, self.context = lookahead, context
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Plan:
        """The next step's chunks; ``advance`` once it ran."""
        budget = self.max_num_batched_tokens
        decodes: list[Chunk] = []
        prefills: list[Chunk] = []
        preempted: list[Sequence] = []
        planned: set[Sequence] = set()
        for decoding in (True, False):
            for seq in list(self.running):  # once a step per running sequence: kept lean
                uncomputed = seq.uncomputed
                if (not budget or not uncomputed or (uncomputed == 1) != decoding
                        or seq in planned or seq in preempted):
                    continue
                length = min(uncomputed, budget)
                if self._make_room(seq, seq.num_computed + length, planned, preempted):
                    (decodes if decoding else prefills).append(
                        Chunk(seq, seq.num_computed, length))
                    planned.add(seq)
                    budget -= length
        # A step that preempted admits nothing: the pool just proved too small.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            self.running.append(chunk.seq)
            prefills.append(chunk)
            budget -= chunk.length
        return Plan(self._with_room(decodes, budget) + prefills)

    def _with_room(self, decodes: list[Chunk], budget: int) -> list[Chunk]:
        """The decode chunks, each given room for drafted tokens out of what the step left:
        its token budget and the pool's free blocks (a draft never preempts, nor takes from
        a prompt's chunk), and within the context (the last draft's position below it)."""
        if not self.lookahead:
            return decodes
        assert self.context is not None
        given = []
        for chunk in decodes:
            end = chunk.start + chunk.length
            room = max(0, min(self.lookahead, budget, self.context - end))
            while room and not self.blocks.grow(chunk.seq.table, end + room):
                room -= 1
            budget -= room
            given.append(dataclasses.replace(chunk, room=room))
        return given

    def _make_room(self, seq: Sequence, tokens: int, planned: set[Sequence],
                   preempted: list[Sequence]) -> bool:
        """Blocks for ``seq`` to hold ``tokens`` tokens, preempting the newest running
        sequences not in the step until there are; False if ``seq`` itself was preempted."""
        while not self.blocks.grow(seq.table, tokens):
            victim = next(s for s in reversed(self.running) if s not in planned)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.table)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _admit(self, seq: Sequence, budget: int) -> Chunk | None:
        """The first chunk of a waiting sequence, its cached prefix reused, if the budget
        and the pool allow it."""
        matched = self.blocks.match(seq.tokens, seq.root) if seq.reuse_prefix else []
        computed = len(matched) * self.blocks.block_size
        length = min(len(seq.tokens) - computed, budget)
        if not self.chunked_prefill and length < len(seq.tokens) - computed:
            return None
        if self.blocks.cost(matched, computed + length) > self.blocks.free:
            return None
        first = not seq.admitted
        self.blocks.reuse(seq.table, matched, seq.prompt_len if first and seq.reuse_prefix
                          else 0)
        if first:
            seq.cached_tokens, seq.admitted = computed, True
        seq.num_computed = computed
        grown = self.blocks.grow(seq.table, computed + length)
        assert grown
        return Chunk(seq, computed, length)

    def advance(self, plan: Plan) -> None:
        """The step ran: its chunks' keys and values are in the pool, full blocks cached."""
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.num_computed = chunk.start + chunk.length
            self.blocks.register(seq.table, seq.tokens, seq.num_computed, seq.root)

    def accept(self, seq: Sequence, drafted: int) -> None:
        """``drafted`` tokens verified after ``seq``'s last computed one were accepted (now in
        its tokens): their keys and values, written by the step, count as computed, and
        the blocks they fill are cached."""
        seq.num_computed += drafted
        self.blocks.register(seq.table, seq.tokens, seq.num_computed, seq.root)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence (finished, or its client gone), freeing its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.table)
        seq.num_computed = 0
