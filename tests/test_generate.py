"""The generation engine: KV-cached continuous batching equal to recomputing every prefix,
batch buckets, the compile fallback, sampling, stop strings and the waiting queue."""

from __future__ import annotations

import asyncio

import pytest
import torch
from generation import completion, greedy, greedy_text, through_engine

from gpuflow.errors import UserError
from gpuflow.models.gpt import GPT, GPTConfig
from gpuflow.serve.generate.engine import (
    Done,
    GenerationEngine,
    WaitingFull,
    cache_slots,
)
from gpuflow.serve.generate.models import GPTDecoder
from gpuflow.serve.generate.sampling import SamplingParams, filter_logits
from gpuflow.serve.generate.text import TextStream


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, seq_len=64, layers=2, dim=32, heads=4)).eval()


def engine_for(model: GPT, slots: int, max_waiting: int = 64,
               **decode: bool) -> GenerationEngine:
    return GenerationEngine(GPTDecoder(model, torch.float32), slots, max_waiting,
                            torch.inference_mode, **decode)


def test_continuous_batching_generates_what_recomputing_every_prefix_does() -> None:
    """Six prompts through three slots: sequences join as others leave, every step decodes
    several sequences at different positions, and each completion is the exact greedy one."""
    model = tiny_gpt()
    prompts = [b"def f(x):", b"import torch", b"a", b"The quick brown fox jumps",
               b"class Engine:\n    ", b"0123456789"]
    budgets = [12, 5, 20, 9, 14, 3]

    results = through_engine(engine_for(model, slots=3), greedy(prompts, budgets), first=4)
    for prompt, budget, (text, _, done) in zip(prompts, budgets, results, strict=True):
        expected = greedy_text(model, prompt, budget)
        assert text == expected, prompt
        assert done.finish_reason == "length" and done.completion_tokens == budget
        assert done.prompt_tokens == len(prompt)


def test_decode_steps_padded_to_batch_buckets_equal_recomputing_every_prefix() -> None:
    """Five slots, buckets 1,2,4,5: as sequences leave and join, the active count crosses
    the bucket sizes; a step of 3 runs as a bucket of 4 whose padding row writes only the
    scratch slot (5, which no request holds) and whose logits are dropped. Every completion
    is the exact greedy one."""
    model = tiny_gpt()
    prompts = [b"def f(x):", b"import torch", b"a", b"The quick brown fox jumps",
               b"class Engine:\n    ", b"0123456789", b"xy"]
    budgets = [12, 5, 20, 9, 14, 3, 17]
    engine = engine_for(model, slots=5, bucketed=True)
    assert engine.runner.buckets == [1, 2, 4, 5] and engine.slots == 5
    assert engine.cache.keys.shape[1] == 6  # the scratch slot beside the five
    assert engine.describe() == "decode eager over batch buckets 1,2,4,5"
    steps: list[list[int]] = []
    step = engine.runner.model_step

    def recorded(tokens, cache, slots, starts):
        steps.append(slots.tolist())
        return step(tokens, cache, slots, starts)

    engine.runner.model_step = recorded
    results = through_engine(engine, greedy(prompts, budgets), first=5)
    for prompt, budget, (text, _, done) in zip(prompts, budgets, results, strict=True):
        assert text == greedy_text(model, prompt, budget)
        assert done.completion_tokens == budget
    assert steps[:4] == [[5], [5, 5], [5] * 4, [5] * 5]  # the warm-up: scratch rows only
    served = steps[4:]
    assert {len(slots) for slots in served} == {1, 2, 4, 5}
    assert any(len(slots) == 4 and slots.count(5) == 1 for slots in served)
    for slots in served:  # padding rows come last, all in the scratch slot
        real = [slot for slot in slots if slot != 5]
        assert slots == real + [5] * (len(slots) - len(real))


def test_a_decode_compile_that_fails_falls_back_to_eager_saying_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def failing(fn, **options):
        def compiled(*args):
            raise RuntimeError("no backend for this model")
        return compiled

    monkeypatch.setattr(torch, "compile", failing)
    model = tiny_gpt()
    engine = engine_for(model, slots=2, compile=True)
    with caplog.at_level("WARNING", logger="gpuflow.serve"):
        (text, _, _), = through_engine(engine, greedy([b"abc"], [6]), first=1)
    assert text == greedy_text(model, b"abc", 6)
    assert "torch.compile of the decode step failed (RuntimeError: no backend" in caplog.text
    assert engine.describe() == ("decode eager over batch buckets 1,2: torch.compile failed "
                                 "(RuntimeError: no backend for this model)")


def test_the_scratch_slot_comes_out_of_the_cache_budget() -> None:
    assert cache_slots(100, 550, 8) == 5 and cache_slots(100, 550, 8, spare=1) == 4
    with pytest.raises(UserError, match="beside the scratch slot"):
        cache_slots(100, 150, 8, spare=1)


def test_sampling_is_repeatable_by_seed_and_stop_strings_end_a_completion() -> None:
    model = tiny_gpt()

    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7)

    async def scenario(runs: list[SamplingParams]) -> list[tuple[str, Done]]:
        engine = engine_for(model, slots=len(runs))
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
        engine = engine_for(model, slots=1)
        engine.start()
        try:
            params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7,
                                    stop=(stop,))
            return await completion(engine.submit(list(b"x = "), params))
        finally:
            engine.stop()

    text, done = asyncio.run(stopped())
    assert text == a[:a.index(stop)] and done.finish_reason == "stop"


def test_a_full_waiting_queue_refuses_and_a_cancelled_request_frees_its_slot() -> None:
    model = tiny_gpt()

    async def scenario() -> tuple[str, Done]:
        engine = engine_for(model, slots=1, max_waiting=1)
        # Not started: requests stay waiting.
        leaving = engine.submit(list(b"abc"), SamplingParams(max_tokens=60, temperature=0.0))
        with pytest.raises(WaitingFull):
            engine.submit(list(b"abc"), SamplingParams(max_tokens=4, temperature=0.0))
        engine.start()
        try:
            await asyncio.wait_for(leaving.events.get(), 10)  # it holds the one slot
            leaving.cancel()
            done = await completion(leaving)
            assert done[1].finish_reason == "cancelled"
            after = engine.submit(list(b"abc"), SamplingParams(max_tokens=4, temperature=0.0))
            return await asyncio.wait_for(completion(after), 10)
        finally:
            engine.stop()

    text, done = asyncio.run(scenario())
    assert done.finish_reason == "length" and len(text.encode("utf-8", "replace")) >= 1


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
