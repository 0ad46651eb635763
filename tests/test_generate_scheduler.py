"""The scheduler and the KV block manager alone: no model, no torch, a pure state machine."""

from __future__ import annotations

import random

import pytest

from gpuflow.serve.generate.blocks import (
    NULL_BLOCK,
    ROOT_KEY,
    BlockManager,
    BlockTable,
    block_key,
)
from gpuflow.serve.generate.limits import EngineLimits
from gpuflow.serve.generate.scheduler import Plan, Scheduler, Sequence


def run(scheduler: Scheduler, plan: Plan, wanted: dict[Sequence, int]) -> list[Sequence]:
    """What the engine does after a step: every final chunk yields a token (its position,
    as a stand-in), and a sequence with ``wanted[seq]`` generated tokens finishes."""
    scheduler.advance(plan)
    done = []
    for chunk in plan.chunks:
        if chunk.final:
            seq = chunk.seq
            seq.tokens.append(len(seq.tokens))
            if len(seq.tokens) - seq.prompt_len >= wanted[seq]:
                scheduler.finish(seq)
                done.append(seq)
    return done


def tokens(plan: Plan) -> int:
    return sum(chunk.length for chunk in plan.chunks)


def drain(scheduler: Scheduler, wanted: dict[Sequence, int],
          steps: int = 1000) -> tuple[list[Sequence], list[Plan]]:
    """Steps until nothing runs or waits: the order sequences finished in, and the plans."""
    finished: list[Sequence] = []
    plans: list[Plan] = []
    for _ in range(steps):
        if not (scheduler.running or scheduler.waiting):
            return finished, plans
        plans.append(scheduler.schedule())
        finished += run(scheduler, plans[-1], wanted)
    raise AssertionError("the sequences never finished")


def test_admission_counts_blocks_not_whole_contexts() -> None:
    blocks = BlockManager(num_blocks=9, block_size=4, prefix_caching=False)  # 8 usable
    scheduler = Scheduler(blocks, max_num_seqs=16, max_num_batched_tokens=64)
    seqs = [Sequence.of(list(range(100 * i, 100 * i + 6))) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    plan = scheduler.schedule()
    # Each 6-token prompt takes two blocks: four of the five fit in eight blocks.
    assert [chunk.seq for chunk in plan.chunks] == seqs[:4]
    assert all(chunk.final and chunk.length == 6 for chunk in plan.chunks)
    assert blocks.used == 8 and list(scheduler.waiting) == seqs[4:]
    run(scheduler, plan, dict.fromkeys(seqs, 100))
    scheduler.finish(seqs[0])
    assert blocks.used == 6
    assert [chunk.seq for chunk in scheduler.schedule().chunks] == [*seqs[1:4], seqs[4]]


def test_a_step_carries_decodes_first_then_prompt_chunks_within_the_token_budget() -> None:
    blocks = BlockManager(num_blocks=64, block_size=4, prefix_caching=False)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=10)
    short = Sequence.of([1, 2, 3])
    scheduler.add(short)
    run(scheduler, scheduler.schedule(), {short: 100})
    long = Sequence.of(list(range(25)))
    scheduler.add(long)
    lengths = []
    while long.num_computed < 25:
        plan = scheduler.schedule()
        assert tokens(plan) <= 10
        assert (plan.chunks[0].seq, plan.chunks[0].length) == (short, 1)  # the stream goes on
        lengths.append(plan.chunks[1].length)
        assert plan.chunks[1].final == (long.num_computed + lengths[-1] == 25)
        run(scheduler, plan, {short: 100, long: 100})
    assert lengths == [9, 9, 7]
    assert len(long.tokens) == 26  # only the last chunk yielded a token


def test_a_step_budget_is_raised_to_a_decode_token_a_sequence_and_whole_prompts() -> None:
    assert EngineLimits(max_num_seqs=4, max_num_batched_tokens=16).step_tokens(64) == 16
    assert EngineLimits(max_num_seqs=32, max_num_batched_tokens=16).step_tokens(64) == 32
    whole = EngineLimits(max_num_seqs=4, max_num_batched_tokens=16, chunked_prefill=False)
    assert whole.step_tokens(64) == 64 and whole.step_tokens(8) == 16


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_it_whole() -> None:
    blocks = BlockManager(num_blocks=64, block_size=4, prefix_caching=False)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=12,
                          chunked_prefill=False)
    first, second = Sequence.of(list(range(8))), Sequence.of(list(range(8)))
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [(c.seq, c.length) for c in plan.chunks] == [(first, 8)]
    run(scheduler, plan, {first: 100, second: 100})
    plan = scheduler.schedule()
    assert [(c.seq, c.length) for c in plan.chunks] == [(first, 1), (second, 8)]


def test_the_newest_running_sequence_is_preempted_and_recomputed_from_what_it_generated(
) -> None:
    blocks = BlockManager(num_blocks=5, block_size=2, prefix_caching=False)  # 4 usable
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=16)
    old, new = Sequence.of([1, 2, 3]), Sequence.of([4, 5, 6])
    scheduler.add(old)
    scheduler.add(new)
    wanted = {old: 3, new: 3}
    for _ in range(2):  # the prompts, then one decode step: four tokens each, four blocks
        run(scheduler, scheduler.schedule(), wanted)
    plan = scheduler.schedule()  # both cross into a third block: the newest must go
    assert [c.seq for c in plan.chunks] == [old]
    assert scheduler.preemptions == 1 and list(scheduler.waiting) == [new]
    assert new.num_computed == 0 and new.table.blocks == []
    finished = run(scheduler, plan, wanted)
    more, plans = drain(scheduler, wanted)
    assert finished + more == [old, new]
    # Recomputed whole: its prompt and the two tokens it had generated, in one chunk.
    assert [(c.seq, c.start, c.length) for c in plans[0].chunks] == [(new, 0, 5)]
    assert new.tokens == [4, 5, 6, 3, 4, 5] and old.tokens == [1, 2, 3, 3, 4, 5]
    assert blocks.used == 0


def test_every_request_finishes_in_arrival_order_under_a_small_pool() -> None:
    blocks = BlockManager(num_blocks=7, block_size=4, prefix_caching=False)
    scheduler = Scheduler(blocks, max_num_seqs=3, max_num_batched_tokens=8)
    seqs = [Sequence.of(list(range(i, i + 5))) for i in range(12)]
    wanted = {seq: 6 for seq in seqs}
    for seq in seqs:
        scheduler.add(seq)
    finished, plans = drain(scheduler, wanted)
    assert finished == seqs  # equal work: first come, first served, none starves
    assert all(len(seq.tokens) == 11 for seq in seqs)
    assert all(tokens(p) <= 8 and len({c.seq for c in p.chunks}) <= 3 for p in plans)
    assert blocks.used == 0


def test_a_long_prompt_at_the_head_of_the_queue_is_not_overtaken_by_short_ones() -> None:
    blocks = BlockManager(num_blocks=9, block_size=4, prefix_caching=False)  # 8 usable
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=32)
    running = Sequence.of(list(range(12)))  # three blocks
    scheduler.add(running)
    run(scheduler, scheduler.schedule(), {running: 3})
    long, short = Sequence.of(list(range(24))), Sequence.of([1])
    scheduler.add(long)  # six blocks: waits for the running one to finish
    scheduler.add(short)
    wanted = {running: 3, long: 1, short: 1}
    finished, _ = drain(scheduler, wanted)
    assert finished == [running, long, short]


def test_a_cached_prefix_is_reused_but_the_last_prompt_token_is_always_computed() -> None:
    blocks = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    system = list(range(100, 108))  # two full blocks
    first = Sequence.of(system + [1, 2, 3])
    scheduler.add(first)
    run(scheduler, scheduler.schedule(), {first: 5})
    again = Sequence.of(system + [7, 8])
    exact = Sequence.of(system)  # whole blocks: the last one is recomputed for its logits
    echo = Sequence.of(system + [9], reuse_prefix=False)
    for seq in (again, exact, echo):
        scheduler.add(seq)
    chunks = {c.seq: c for c in scheduler.schedule().chunks}
    assert (chunks[again].start, chunks[again].length) == (8, 2)
    assert again.cached_tokens == 8 and again.table.blocks[:2] == first.table.blocks[:2]
    assert (chunks[exact].start, chunks[exact].length) == (4, 4)
    assert exact.table.blocks[0] == first.table.blocks[0]
    assert exact.table.blocks[1] != first.table.blocks[1]
    assert (chunks[echo].start, echo.cached_tokens) == (0, 0)
    assert blocks.prefix_queries == 11 + 10 + 8  # the echo request looked nothing up
    assert blocks.prefix_hits == 0 + 8 + 4


def test_a_shared_block_is_freed_only_when_its_last_holder_lets_go() -> None:
    blocks = BlockManager(num_blocks=8, block_size=2)
    table = BlockTable()
    assert blocks.grow(table, 5)
    blocks.register(table, [1, 2, 3, 4, 5], 5)
    shared = blocks.match([1, 2, 3, 4, 9])
    assert shared == table.blocks[:2]
    other = BlockTable()
    blocks.reuse(other, shared)
    assert blocks.grow(other, 5)
    assert blocks.used == 3 + 1
    blocks.release(table)
    assert blocks.used == 3  # the two shared blocks are still held
    blocks.release(other)
    assert blocks.used == 0
    assert blocks.match([1, 2, 3, 4, 9]) == shared  # free, yet still cached


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first() -> None:
    blocks = BlockManager(num_blocks=7, block_size=2)  # 6 usable
    prompts = [[1, 1, 9], [2, 2, 9], [3, 3, 9]]
    for prompt in prompts:  # each prompt: one full cached block and a private one
        table = BlockTable()
        assert blocks.grow(table, 3)
        blocks.register(table, prompt, 3)
        blocks.release(table)
    assert all(blocks.match(p) for p in prompts) and blocks.used == 0
    touched = BlockTable()
    blocks.reuse(touched, blocks.match(prompts[0]))  # the oldest prompt is used again
    blocks.release(touched)
    hog = BlockTable()
    assert blocks.grow(hog, 6)  # three blocks: two private ones, then one eviction
    assert [bool(blocks.match(p)) for p in prompts] == [True, False, True]
    assert not blocks.grow(hog, 14)  # seven blocks: more than the pool; nothing is taken
    assert len(hog.blocks) == 3


def test_the_null_block_is_never_handed_out() -> None:
    blocks = BlockManager(num_blocks=4, block_size=1)
    table = BlockTable()
    assert blocks.grow(table, 3)
    assert NULL_BLOCK not in table.blocks and sorted(table.blocks) == [1, 2, 3]
    assert not blocks.grow(table, 4)
    assert blocks.total == 3 and blocks.free == 0
    with pytest.raises(ValueError, match="null block"):
        BlockManager(num_blocks=1, block_size=16)


def test_prefix_caching_off_finds_nothing() -> None:
    blocks = BlockManager(num_blocks=8, block_size=2, prefix_caching=False)
    table = BlockTable()
    assert blocks.grow(table, 4)
    blocks.register(table, [1, 2, 3, 4], 4)
    assert blocks.match([1, 2, 3, 4, 5]) == [] and blocks.prefix_hits == 0


def test_a_block_key_is_a_digest_of_its_parent_chain_and_its_tokens() -> None:
    first = block_key(ROOT_KEY, [1, 2])
    assert block_key(ROOT_KEY, [1, 2]) == first and len(first) == 32
    assert block_key(ROOT_KEY, [2, 1]) != first
    assert block_key(ROOT_KEY, [1, 2 + (2**61 - 1)]) != first  # hash() takes these alike
    assert block_key(first, [5, 6]) != block_key(block_key(ROOT_KEY, [1, 3]), [5, 6])
    assert block_key(first, [5, 6]) != block_key(ROOT_KEY, [5, 6])


def test_different_prefixes_never_share_a_cached_block() -> None:
    """Python's ``hash()`` takes 2 and 2 + (2**61 - 1) alike, so a chain of ``hash()``
    keys gave the second prompt the first one's block after their differing blocks."""
    blocks = BlockManager(num_blocks=16, block_size=2)
    first, second = [1, 2, 5, 6, 7], [1, 2 + (2**61 - 1), 5, 6, 7]
    tables = []
    for tokens in (first, second):
        table = BlockTable()
        assert blocks.grow(table, 5)
        blocks.register(table, tokens, 5)
        tables.append(table)
    assert blocks.match(first) == tables[0].blocks[:2]
    assert blocks.match(second) == tables[1].blocks[:2]
    assert not set(tables[0].blocks) & set(tables[1].blocks)


def test_random_traffic_keeps_the_pool_consistent() -> None:
    """Arrivals with shared prefixes, cancellations and preemptions over a small pool, at
    random (seeded): every step's chunks fit their tables and the budgets, no table holds
    the null block, shared blocks are held by each sharer, and all blocks come back."""
    rng = random.Random(0)
    blocks = BlockManager(num_blocks=14, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=5, max_num_batched_tokens=12)
    prefixes = [[rng.randrange(256) for _ in range(n)] for n in (3, 9, 14)]
    wanted: dict[Sequence, int] = {}
    for step in range(400):
        if step < 300 and rng.random() < 0.3:
            seq = Sequence.of(rng.choice(prefixes) + [rng.randrange(256)
                                                      for _ in range(rng.randrange(1, 8))],
                              reuse_prefix=rng.random() < 0.8)
            wanted[seq] = rng.randrange(1, 12)
            scheduler.add(seq)
        if scheduler.running and rng.random() < 0.05:
            scheduler.finish(rng.choice(scheduler.running))  # a client that left
        plan = scheduler.schedule()
        assert tokens(plan) <= 12 and len(scheduler.running) <= 5
        for chunk in plan.chunks:
            table = chunk.seq.table.blocks
            assert NULL_BLOCK not in table
            assert len(table) * 4 >= chunk.start + chunk.length
        held = [b for seq in scheduler.running for b in seq.table.blocks]
        assert len(set(held)) + blocks.free == blocks.total  # each held block counted once
        run(scheduler, plan, wanted)
    drain(scheduler, wanted)
    assert blocks.used == 0 and not scheduler.running and not scheduler.waiting
    assert scheduler.preemptions > 0 and blocks.prefix_hits > 0
