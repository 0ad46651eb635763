"""The generation engine: continuous batching over a paged KV cache equal to recomputing
every prefix (with prefix caching, chunked prefill and preemption, each on and off), batch
buckets, the compile fallback, sampling, stop strings, prompt log-probabilities and the
waiting queue."""

from __future__ import annotations

import asyncio

import pytest
import torch
from generation import completion, greedy, greedy_reference, greedy_text, through_engine

from gpuflow.errors import UserError
from gpuflow.models.gpt import GPT, GPTConfig
from gpuflow.serve.generate.budget import pool_blocks
from gpuflow.serve.generate.build import build_core, build_engine
from gpuflow.serve.generate.engine import GenerationEngine
from gpuflow.serve.generate.limits import EngineLimits
from gpuflow.serve.generate.messages import Inbox, NewRequest
from gpuflow.serve.generate.models import GPTDecoder
from gpuflow.serve.generate.requests import Done, Event, Failed, Generation, WaitingFull
from gpuflow.serve.generate.runner import ModelRunner, compile_mode
from gpuflow.serve.generate.sampling import SamplingParams, filter_logits, greedy_ids
from gpuflow.serve.generate.text import TextStream


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, seq_len=64, layers=2, dim=32, heads=4)).eval()


def engine_for(model: GPT, max_num_seqs: int, max_queue: int = 64, num_blocks: int = 64,
               bucketed: bool = False, compile: bool = False,
               **limits: int | bool) -> GenerationEngine:
    """An engine over ``num_blocks`` blocks (of 16 tokens unless ``limits`` say)."""
    return build_engine(GPTDecoder(model, torch.float32), num_blocks,
                        EngineLimits(max_num_seqs, max_queue, **limits),  # type: ignore[arg-type]
                        torch.inference_mode, bucketed, compile)


def test_continuous_batching_generates_what_recomputing_every_prefix_does() -> None:
    """Six prompts, three sequences at a time: sequences join as others leave, every step
    decodes several sequences at different positions, and each completion is the exact
    greedy one."""
    model = tiny_gpt()
    prompts = [b"def f(x):", b"import torch", b"a", b"The quick brown fox jumps",
               b"class Engine:\n    ", b"0123456789"]
    budgets = [12, 5, 20, 9, 14, 3]

    results = through_engine(engine_for(model, 3), greedy(prompts, budgets), first=4)
    for prompt, budget, (text, _, done) in zip(prompts, budgets, results, strict=True):
        expected = greedy_text(model, prompt, budget)
        assert text == expected, prompt
        assert done.finish_reason == "length" and done.completion_tokens == budget
        assert done.prompt_tokens == len(prompt)


def test_a_steps_lone_tokens_cross_as_two_columns() -> None:
    """A request's first output (its cached tokens) and its last (its finish) are
    ``Output``s; a step in which it took one token and nothing else reports it in the
    report's ``token_ids``/``tokens`` columns. A request that asks log-probabilities keeps
    an ``Output`` a step."""
    model = tiny_gpt()
    core = build_core(GPTDecoder(model, torch.float32), 64, EngineLimits(4, 16))
    plain = SamplingParams(max_tokens=5, temperature=0.0)
    scored = SamplingParams(max_tokens=5, temperature=0.0, logprobs=1)
    core.receive(Inbox((NewRequest(0, list(b"def f"), plain),
                        NewRequest(1, list(b"x ="), scored))))
    taken: dict[int, list[tuple[str, int]]] = {0: [], 1: []}
    with torch.inference_mode():
        while not core.idle:
            report = core.step()
            for output in () if report is None else report.outputs:
                taken[output.id] += [("output", token) for token in output.tokens]
            for request_id, token in zip(*(() if report is None else
                                           (report.token_ids, report.tokens)), strict=True):
                taken[request_id].append(("lone", token))
    core.stop()
    assert [kind for kind, _ in taken[0]] == ["output", "lone", "lone", "lone", "output"]
    assert [kind for kind, _ in taken[1]] == ["output"] * 5
    for request_id, prompt in ((0, b"def f"), (1, b"x =")):
        assert [token for _, token in taken[request_id]] == greedy_reference(model, prompt, 5)


def test_decode_steps_padded_to_batch_buckets_equal_recomputing_every_prefix() -> None:
    """Five sequences at a time, buckets 1,2,4,5: as sequences leave and join, the running
    count crosses the bucket sizes; a step of 3 runs as a bucket of 4 whose padding row
    writes only the null block and whose logits are dropped. Every completion is the exact
    greedy one."""
    model = tiny_gpt()
    prompts = [b"def f(x):", b"import torch", b"a", b"The quick brown fox jumps",
               b"class Engine:\n    ", b"0123456789", b"xy"]
    budgets = [12, 5, 20, 9, 14, 3, 17]
    engine = engine_for(model, 5, bucketed=True)
    assert engine.core.runner.buckets == [1, 2, 4, 5]
    assert engine.describe() == "decode eager over batch buckets 1,2,4,5"
    steps: list[list[int]] = []
    step = engine.core.runner.model_step

    def recorded(tokens, positions, slot_mapping, block_tables, pool):
        assert block_tables.shape[1] == 4  # a whole context: 64 tokens in blocks of 16
        steps.append(slot_mapping.tolist())
        return step(tokens, positions, slot_mapping, block_tables, pool)

    engine.core.runner.model_step = recorded
    results = through_engine(engine, greedy(prompts, budgets), first=5)
    for prompt, budget, (text, _, done) in zip(prompts, budgets, results, strict=True):
        assert text == greedy_text(model, prompt, budget)
        assert done.completion_tokens == budget
    assert steps[:4] == [[0], [0, 0], [0] * 4, [0] * 5]  # the warm-up: null-block rows only
    served = steps[4:]
    assert {len(slots) for slots in served} >= {2, 4, 5}
    assert any(len(slots) == 4 and slots.count(0) == 1 for slots in served)
    for slots in served:  # padding rows come last, all in the null block
        real = [slot for slot in slots if slot != 0]
        assert slots == real + [0] * (len(slots) - len(real))


SYSTEM = b"You are terse. Answer in one line. "  # 35 bytes: two blocks of 16 and more


@pytest.mark.parametrize("limits", [
    {"block_size": 4, "max_num_batched_tokens": 16},  # prefix cache and chunks of prompts
    {"block_size": 4, "max_num_batched_tokens": 16, "prefix_caching": False},
    {"block_size": 4, "chunked_prefill": False},
    {"num_blocks": 17, "block_size": 4},  # one context's blocks: three sequences preempt
], ids=["cached-chunked", "no-prefix-cache", "no-chunked-prefill", "preempting"])
def test_paged_generation_equals_recomputing_every_prefix(limits: dict) -> None:
    """Prompts sharing a system prompt arrive in two waves; whatever the engine reuses,
    splits or preempts, each greedy completion is the exact one."""
    model = tiny_gpt()
    prompts = [SYSTEM + p for p in (b"def f(x):", b"import torch", b"a", b"0123")] + [b"xy"]
    budgets = [12, 5, 20, 9, 14]
    engine = engine_for(model, 3, **limits)
    results = through_engine(engine, greedy(prompts, budgets), first=2)
    for prompt, budget, (text, _, done) in zip(prompts, budgets, results, strict=True):
        assert text == greedy_text(model, prompt, budget), prompt
        assert done.completion_tokens == budget
    blocks = engine.core.scheduler.blocks
    assert blocks.used == 0  # every sequence gave its blocks back
    cached = [done.cached_tokens for _, _, done in results]
    if blocks.prefix_caching:  # the later arrivals found the system prompt's blocks
        assert cached[2] >= 32 and cached[4] == 0 and blocks.prefix_hits > 0
    else:
        assert cached == [0] * 5
    assert (engine.core.scheduler.preemptions > 0) == ("num_blocks" in limits)


def test_prompt_logprobs_are_exact_when_the_prompt_is_cached() -> None:
    """A request that wants its prompt's log-probabilities computes the prompt itself, in
    chunks, though its prefix is cached; one that does not reuses it, same completion."""
    model = tiny_gpt()
    prompt = list(SYSTEM + b"2 + 2 =")
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt]))[0], -1)
    wanted = [p[prompt[i + 1]] for i, p in enumerate(expected[:-1].tolist())]

    async def scenario() -> list[Generation]:
        engine = engine_for(model, 2, block_size=4, max_num_batched_tokens=8)
        engine.start()
        try:
            runs = []
            for logprobs in (None, 2, None):
                params = SamplingParams(max_tokens=4, temperature=0.0,
                                        prompt_logprobs=logprobs)
                runs.append(engine.submit(prompt, params))
                await completion(runs[-1])
            return runs
        finally:
            engine.stop()

    first, scored, reused = asyncio.run(scenario())
    assert scored.cached_tokens == 0 and reused.cached_tokens == 40
    assert first.generated == scored.generated == reused.generated
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    got = [entry.logprob for entry in scored.prompt_logprobs[1:]]
    assert got == pytest.approx(wanted, abs=1e-5)
    assert all(len(entry.top) == 2 for entry in scored.prompt_logprobs[1:])


def test_a_decode_compile_that_fails_falls_back_to_eager_saying_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def failing(fn, **options):
        def compiled(*args):
            raise RuntimeError("no backend for this model")
        return compiled

    monkeypatch.setattr(torch, "compile", failing)
    model = tiny_gpt()
    engine = engine_for(model, 2, compile=True)
    with caplog.at_level("WARNING", logger="gpuflow.serve"):
        (text, _, _), = through_engine(engine, greedy([b"abc"], [6]), first=1)
    assert text == greedy_text(model, b"abc", 6)
    assert "torch.compile of the decode step failed (RuntimeError: no backend" in caplog.text
    assert engine.describe() == ("decode eager over batch buckets 1,2: torch.compile failed "
                                 "(RuntimeError: no backend for this model)")


def test_max_autotune_tunes_the_decode_step_over_weights_frozen_while_it_compiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plumbing (an autotuned compile takes tens of seconds: benchmarks/generation.py
    --max-autotune measures its speed, benchmarks/autotune_equality.py its logits against
    eager's)."""
    assert compile_mode(cuda_graphs=False, max_autotune=False) is None
    assert compile_mode(cuda_graphs=True, max_autotune=False) == "reduce-overhead"
    assert compile_mode(cuda_graphs=True, max_autotune=True) == "max-autotune"
    compiled: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda step, **options: compiled.append(options)
                        or step)
    runner = ModelRunner(GPTDecoder(tiny_gpt(), torch.float32), 16, 16, 2, max_autotune=True)
    assert compiled == [{"mode": "max-autotune-no-cudagraphs", "dynamic": False}]
    assert runner.describe() == "decode compiled for batch buckets 1,2, max-autotune"
    freezing: list[bool] = []
    monkeypatch.setattr(runner, "_warm_buckets",
                        lambda: freezing.append(torch._inductor.config.freezing))
    runner.warm_up()
    assert freezing == [True] and not torch._inductor.config.freezing


def test_the_pool_holds_what_the_budget_allows_between_one_context_and_all_sequences(
) -> None:
    # 100 bytes a block, a context of 64 tokens in blocks of 16: four blocks and the null one.
    assert pool_blocks(100, 1_000, 16, 64, max_seqs=8) == 10
    assert pool_blocks(100, 1_000_000, 16, 64, max_seqs=8) == 8 * 4 + 1
    with pytest.raises(UserError, match="cannot hold one sequence"):
        pool_blocks(100, 450, 16, 64, max_seqs=8)


def test_sampling_is_repeatable_by_seed_and_stop_strings_end_a_completion() -> None:
    model = tiny_gpt()

    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7)

    async def scenario(runs: list[SamplingParams]) -> list[tuple[str, Done]]:
        engine = engine_for(model, len(runs))
        engine.start()
        try:
            return await asyncio.gather(*(completion(engine.submit(list(b"x = "), params))
                                          for params in runs))
        finally:
            engine.stop()

    expected = greedy_text(model, b"x = ", 24)
    (a, _), (b, _), (c, _), (top1, _), (argmax, _) = asyncio.run(scenario([
        seeded, seeded, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=8),
        SamplingParams(max_tokens=24, temperature=1.0, top_k=1, seed=9),
        SamplingParams(max_tokens=24, temperature=0.0)]))
    assert a == b and a != c
    assert top1 == expected and argmax == expected
    [(alone, _)] = asyncio.run(scenario([seeded]))  # batched with nothing else
    assert alone == a
    stop = a[5:7]  # a stop string that the seeded completion reaches

    async def stopped() -> tuple[str, Done]:
        engine = engine_for(model, 1)
        engine.start()
        try:
            params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7,
                                    stop=(stop,))
            return await completion(engine.submit(list(b"x = "), params))
        finally:
            engine.stop()

    text, done = asyncio.run(stopped())
    assert text == a[:a.index(stop)] and done.finish_reason == "stop"


def test_a_full_waiting_queue_refuses_and_a_cancelled_request_frees_its_blocks() -> None:
    model = tiny_gpt()

    async def scenario() -> tuple[str, Done]:
        engine = engine_for(model, 1, max_queue=1)
        # Not started: requests stay waiting.
        leaving = engine.submit(list(b"abc"), SamplingParams(max_tokens=60, temperature=0.0))
        with pytest.raises(WaitingFull):
            engine.submit(list(b"abc"), SamplingParams(max_tokens=4, temperature=0.0))
        engine.start()
        try:
            await asyncio.wait_for(leaving.events.get(), 10)  # the one sequence running
            assert engine.core.scheduler.blocks.used == 1
            leaving.cancel()
            done = await completion(leaving)
            assert done[1].finish_reason == "cancelled"
            assert engine.core.scheduler.blocks.used == 0
            after = engine.submit(list(b"abc"), SamplingParams(max_tokens=4, temperature=0.0))
            return await asyncio.wait_for(completion(after), 10)
        finally:
            engine.stop()

    text, done = asyncio.run(scenario())
    assert done.finish_reason == "length" and len(text.encode("utf-8", "replace")) >= 1


def test_a_failing_step_fails_its_sequences_and_the_engine_serves_on() -> None:
    """The step that raises fails the sequences in it, not those still waiting, and frees
    their blocks; the next request is served."""
    model = tiny_gpt()
    engine = engine_for(model, 1, block_size=4)
    run = engine.core.runner.run_flat
    calls = {"n": 0}

    def flaky(rows, patch=None):
        calls["n"] += 1
        if calls["n"] == 2:  # the first prompt's second step
            raise RuntimeError("device lost")
        return run(rows, patch)

    engine.core.runner.run_flat = flaky

    async def scenario() -> tuple[list[Event], tuple[str, Done]]:
        engine.start()
        try:
            params = SamplingParams(max_tokens=4, temperature=0.0)
            failing = engine.submit(list(b"abc"), params)
            waiting = engine.submit(list(b"xyz"), params)  # one sequence at a time: it waits
            events = [await asyncio.wait_for(failing.events.get(), 10)]
            while not isinstance(events[-1], Failed | Done):
                events.append(await asyncio.wait_for(failing.events.get(), 10))
            return events, await asyncio.wait_for(completion(waiting), 10)
        finally:
            engine.stop()

    events, (text, done) = asyncio.run(scenario())
    assert isinstance(events[-1], Failed) and "RuntimeError: device lost" in events[-1].message
    assert text == greedy_text(model, b"xyz", 4) and done.finish_reason == "length"
    assert engine.core.scheduler.blocks.used == 0


def test_text_stream_holds_back_what_may_start_a_stop() -> None:
    """A stop split over several pieces of text is found whole and never sent; the text
    the detokenizer still held at the end goes through the stops too."""
    stream = TextStream(["\n\n", "END"])
    sent = [stream.feed(t) for t in ("ab", "c\n", "d", "E", "N", "D", "more")]
    assert "".join(sent) == "abc\nd" and stream.stopped and stream.finish("x") == ""
    held = TextStream(["END"])
    assert held.feed("aE") == "" and held.finish("ND!") == "a" and held.stopped
    plain = TextStream([])
    assert plain.feed("é€") == "é€" and plain.finish("ok") == "ok"


def test_top_k_and_top_p_keep_the_most_probable_tokens() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits, 2, 1.0))[2:].all()
    probs = torch.softmax(logits, -1)  # 0.64, 0.24, 0.09, ...: 0.8 needs the first two
    kept = ~torch.isinf(filter_logits(logits, 0, 0.8))
    assert kept.tolist() == [True, True, False, False, False]
    assert probs[:2].sum() >= 0.8


def test_greedy_ids_take_the_first_of_tied_maxima_as_argmax_does() -> None:
    torch.manual_seed(0)
    for _ in range(50):
        logits = torch.randint(0, 4, (9, 64)).float()  # many ties
        assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
    assert int(greedy_ids(torch.tensor([1.0, 3.0, 3.0]))) == 1
