"""Speculative decoding: prompt lookup and a draft model propose, the served model verifies
in one forward; greedy text is exactly the text without speculation, sampled text keeps the
model's distribution (rejection sampling, checked statistically)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from conftest import serving
from generation import completion as completion_of
from generation import greedy, greedy_reference, greedy_text, through_engine
from test_generate import engine_for, tiny_gpt
from torch.overrides import TorchFunctionMode

from gpuflow.cli import main
from gpuflow.models.gpt import GPT, GPTConfig
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.generate.build import build_engine
from gpuflow.serve.generate.grammar import Constraint
from gpuflow.serve.generate.limits import EngineLimits
from gpuflow.serve.generate.models import GPTDecoder
from gpuflow.serve.generate.requests import Done
from gpuflow.serve.generate.sampling import Sampler, SamplingParams, choose_tokens
from gpuflow.serve.generate.speculate import Draft, NgramIndex, lookup, verified

PROMPTS = [b"def f(x):\n    return x + 1\ndef g(x):\n    return", b"abcabcabcabc",
           b"import torch", b"The quick brown fox", b"xy"]
BUDGETS = [15, 25, 20, 12, 30]


def test_prompt_lookup_drafts_what_followed_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(tokens, 2, 3, 1) == [7, 8]  # "2 3" last seen before "7 8"
    assert lookup(tokens + [7], 4, 3, 1) == [8, 5, 2, 3]  # "2 3 7", the longest match
    assert lookup(tokens + [7], 7, 3, 1) == [8, 5, 2, 3, 7, 8, 5]  # the copy goes on
    assert lookup([4, 1, 2, 1, 2], 5, 2, 1) == [1, 2, 1, 2, 1]  # a loop of period 2
    assert lookup([4, 5, 6], 3, 3, 1) == []  # nothing repeats
    assert lookup(tokens, 0, 3, 1) == []
    assert lookup([1, 2, 1], 5, 3, 2) == []  # a one-token match is below min_ngram


def scanned(tokens: list[int], count: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup by a scan of every earlier window: the reference for the index."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts and count > 0:
            follow = starts[-1] + n
            draft = tokens[follow:follow + count]
            while len(draft) < count:
                draft.append(draft[len(draft) - (len(tokens) - follow)])
            return draft
    return []


def test_the_ngram_index_kept_up_to_date_drafts_what_a_scan_drafts() -> None:
    """One index per sequence, brought up to date as one to three tokens arrive at a time
    (accepted drafts), drafts at every length what a scan of the whole list drafts."""
    rng = random.Random(0)
    for trial in range(40):
        vocab, max_ngram = rng.choice([2, 3, 5, 50]), rng.randint(1, 4)
        min_ngram = rng.randint(1, max_ngram)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        index = NgramIndex(max_ngram, min_ngram)
        while len(tokens) < 60:
            count = rng.randint(0, 6)
            assert index.draft(tokens, count) == scanned(tokens, count, max_ngram, min_ngram), (
                trial, tokens, count)
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))
    index = NgramIndex(3, 1)
    index.draft([1, 2, 3, 1, 2], 2)
    assert index.draft([4, 5, 4], 2) == [5, 4]  # a shorter list: indexed afresh
    prompt = [rng.randrange(3) for _ in range(50)]
    index = NgramIndex(3, 1, budget=16)  # a long prompt: indexed 16 tokens a call
    assert [index.draft(prompt, 2) for _ in range(3)] == [[], [], []]
    assert index.draft(prompt, 2) == scanned(prompt, 2, 3, 1)  # caught up at 64 >= 50


def draft_gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=256, seq_len=64, layers=1, dim=16, heads=2)).eval()


@pytest.mark.parametrize("setup", [
    {"num_speculative_tokens": 4},
    {"num_speculative_tokens": 3, "block_size": 4, "max_num_batched_tokens": 8},
    {"num_speculative_tokens": 4, "num_blocks": 17, "block_size": 4},  # preempting
    {"num_speculative_tokens": 4, "bucketed": True},
    {"num_speculative_tokens": 4, "draft": "same"},  # a draft that is always right
    {"num_speculative_tokens": 4, "draft": "same", "num_blocks": 17, "block_size": 4},
    {"num_speculative_tokens": 2, "draft": "other", "block_size": 4},
], ids=["lookup", "lookup-small-budget", "lookup-preempting", "lookup-bucketed",
        "draft-same", "draft-same-preempting", "draft-other"])
def test_speculative_greedy_text_is_the_text_without_it(setup: dict) -> None:
    """Sequences join and leave while drafts are accepted and refused; every greedy
    completion is the one recomputing every prefix gives, and every block comes back."""
    model = tiny_gpt()
    options = dict(setup)
    draft = options.pop("draft", None)
    if draft is None:
        engine = engine_for(model, 3, **options)
    else:
        drafter = model if draft == "same" else draft_gpt(1)
        num_blocks = options.pop("num_blocks", 64)
        engine = build_engine(GPTDecoder(model, torch.float32), num_blocks,
                              EngineLimits(3, 64, **options), torch.inference_mode,
                              draft=GPTDecoder(drafter, torch.float32))
    results = through_engine(engine, greedy(PROMPTS, BUDGETS), first=3)
    for prompt, budget, (text, _, done) in zip(PROMPTS, BUDGETS, results, strict=True):
        assert text == greedy_text(model, prompt, budget), prompt
        assert done.completion_tokens == budget
    assert engine.core.scheduler.blocks.used == 0
    assert engine.core.accepted > 0 and engine.core.drafted >= engine.core.accepted
    if draft == "same":  # every draft is the served model's own argmax, even after a
        assert engine.core.accepted == engine.core.drafted  # preemption recomputed its keys
    assert (engine.core.scheduler.preemptions > 0) == ("num_blocks" in setup)


def test_a_prompt_reusing_blocks_written_with_drafts_and_an_end_inside_a_draft() -> None:
    """An end-of-sequence id chosen instead of a draft ends a completion in the middle of
    a verification; a second request whose prompt is the first's prompt and completion
    then reuses the blocks the first filled with accepted drafts: both give the greedy
    text without speculation."""
    model = tiny_gpt()
    prompt = b"xy"
    completion = greedy_reference(model, prompt, 40)  # 121, 121, 221 x 10, 235, ...
    eos = completion[12]  # where a run of accepted 221s meets the model's 235
    engine = build_engine(GPTDecoder(model, torch.float32), 64,
                          EngineLimits(2, 64, block_size=4, num_speculative_tokens=4),
                          torch.inference_mode, eos_ids=[eos])
    follow_up = prompt + bytes(completion[:12])

    async def one_after_the_other() -> list[tuple[list[int], Done]]:
        engine.start()
        try:
            await asyncio.to_thread(engine.wait_warm, 60)
            done = []
            for text, params in ((prompt, SamplingParams(max_tokens=40, temperature=0.0)),
                                 (follow_up, SamplingParams(max_tokens=8, temperature=0.0,
                                                            ignore_eos=True))):
                generation = engine.submit(list(text), params)
                done.append((generation.generated, (await completion_of(generation))[1]))
            return done
        finally:
            engine.stop()

    (first, first_done), (second, second_done) = asyncio.run(one_after_the_other())
    assert first == completion[:completion.index(eos)]
    assert first_done.finish_reason == "stop"
    assert second == greedy_reference(model, follow_up, 8)
    # Every full block of the follow-up's prompt but the last token's: generated tokens.
    assert second_done.cached_tokens == 12
    assert engine.core.accepted > 0 and engine.core.scheduler.blocks.used == 0


def test_a_failing_draft_model_leaves_decoding_undrafted_and_exact() -> None:
    """The draft model's forward fails on two steps (a prompt's and a decode's): those steps
    decode without drafts, the draft catches up on its keys later, and every completion is
    the exact greedy one with drafts accepted after the failures."""
    model = tiny_gpt()
    engine = build_engine(GPTDecoder(model, torch.float32), 64,
                          EngineLimits(3, 64, num_speculative_tokens=3), torch.inference_mode,
                          draft=GPTDecoder(model, torch.float32))
    runner = engine.core.proposer.runner  # type: ignore[union-attr]
    run, calls = runner.run, [0]

    def flaky(rows):
        calls[0] += 1
        if calls[0] in (1, 6):
            raise RuntimeError("out of memory")
        return run(rows)

    runner.run = flaky
    results = through_engine(engine, greedy(PROMPTS[:3], BUDGETS[:3]), first=3)
    for prompt, budget, (text, _, _) in zip(PROMPTS, BUDGETS, results, strict=False):
        assert text == greedy_text(model, prompt, budget)
    assert calls[0] > 6 and engine.core.accepted == engine.core.drafted > 0


def test_a_seeded_sampled_request_is_not_drafted_for() -> None:
    """Drafts change how many random draws a sampled token takes: a seeded request gets
    none, so its text is the one the seed gives without speculation."""
    model = tiny_gpt()
    requests = [(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.9, seed=11))]
    plain = through_engine(engine_for(model, 2), requests, first=1)
    engine = engine_for(model, 2, num_speculative_tokens=4)
    assert through_engine(engine, requests, first=1)[0].tokens == plain[0].tokens
    assert engine.core.drafted == 0


def test_penalties_hold_over_accepted_drafts() -> None:
    """A frequency penalty counts each accepted draft before the next is verified: greedy
    text with the penalty (which changes every completion here) is the same with and
    without speculation, drafts accepted among it."""
    model = tiny_gpt()
    params = SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=0.02)
    unpenalized = through_engine(engine_for(model, 3), greedy(PROMPTS[:3], [20] * 3), first=3)
    requests = [(prompt, params) for prompt in PROMPTS[:3]]
    plain = through_engine(engine_for(model, 3), requests, first=3)
    engine = engine_for(model, 3, num_speculative_tokens=4)
    drafted = through_engine(engine, requests, first=3)
    assert all(a.tokens != b.tokens for a, b in zip(plain, unpenalized, strict=True))
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    assert engine.core.accepted > 0


@pytest.mark.parametrize("draft_kind", ["prompt-lookup", "draft-model"])
def test_rejection_sampling_keeps_the_model_distribution(draft_kind: str) -> None:
    """The first token a verification yields is distributed as the request's own
    distribution ``p`` (temperature 0.8, top-k 5) whatever drafted it: 20,000 seeded draws
    over a 6-token vocabulary, each frequency within 0.012 of ``p`` (3.4 standard
    deviations of the largest; keeping every draft as is would be off by 0.5 or more)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=5, seed=7))
    p = torch.softmax(logits.masked_fill(logits == -1.0, float("-inf")) / 0.8, dim=-1)
    q = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.05, 0.05])  # a poor draft's distribution
    draws = 20_000
    counts = torch.zeros(6)
    for _ in range(draws):
        if draft_kind == "prompt-lookup":  # a certain draft: always token 3
            draft = Draft([3])
        else:
            token = int(torch.multinomial(q, 1, generator=sampler.generator))
            draft = Draft([token], q[None])
        counts[next(verified(sampler, logits[None].repeat(2, 1), draft))] += 1
    assert torch.allclose(counts / draws, p, atol=0.012), (counts / draws, p)


def test_a_server_drafting_with_its_own_model_accepts_every_draft(
        textlm_run: tuple[Path, GPT]) -> None:
    """``--draft-model`` of the served run itself: greedy text as without drafts, ``n`` 2
    sampled choices, and every draft accepted (the draft's distribution is the model's, so
    rejection sampling accepts with probability 1), as /metrics says."""
    run_dir, model = textlm_run
    settings = ServeSettings(str(run_dir), device="cpu", max_batch_size=4,
                             num_speculative_tokens=3, draft_model=str(run_dir),
    engine_process=False)

    async def scenario() -> tuple[dict, dict, str]:
        async with serving(create_app(settings)) as client:
            greedy_answer = (await client.post("/v1/completions", json={
                "prompt": "def main():", "max_tokens": 12, "temperature": 0})).json()
            sampled = (await client.post("/v1/completions", json={
                "prompt": "import os", "max_tokens": 10, "n": 2, "seed": 3})).json()
            return greedy_answer, sampled, (await client.get("/metrics")).text

    greedy_answer, sampled, metrics = asyncio.run(scenario())
    assert greedy_answer["choices"][0]["text"] == greedy_text(model, b"def main():", 12)
    assert [choice["index"] for choice in sampled["choices"]] == [0, 1]
    assert sampled["usage"]["completion_tokens"] == 20
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("gpuflow_spec_decode")}
    assert values["gpuflow_spec_decode_draft_tokens_total"] > 0
    assert values["gpuflow_spec_decode_accepted_tokens_total"] == \
        values["gpuflow_spec_decode_draft_tokens_total"]
    assert values["gpuflow_spec_decode_acceptance_rate"] == 1.0


def test_speculation_flags_are_checked_before_the_server_starts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", str(tmp_path), "--num-speculative-tokens", "-1"]) == 2
    assert main(["serve", str(tmp_path), "--draft-model", str(tmp_path)]) == 2  # no K
    assert main(["serve", str(tmp_path), "--num-speculative-tokens", "4",
                 "--draft-model", str(tmp_path / "missing")]) == 2
    assert main(["serve", str(tmp_path), "--num-speculative-tokens", "4",
                 "--prompt-lookup-max", "0"]) == 2


def test_greedy_rows_are_chosen_where_the_logits_are_and_only_sampled_rows_move() -> None:
    """A batch's plain greedy rows take one argmax on the logits' device; only a sampled row
    (a CPU generator draws it) is moved to the host, whole, alone."""
    moved: list[tuple[int, ...]] = []

    class Moves(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func is torch.Tensor.cpu:
                moved.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    logits = torch.randn(4, 50)
    greedy_rows = [Sampler(SamplingParams(temperature=0.0)) for _ in range(4)]
    with Moves():
        assert choose_tokens(greedy_rows, logits) == logits.argmax(dim=-1).tolist()
    assert moved == []
    sampled = Sampler(SamplingParams(temperature=0.8, seed=3))
    with Moves():
        tokens = choose_tokens([*greedy_rows[:2], sampled, greedy_rows[3]], logits)
    assert moved == [(50,)] and tokens[:2] == logits[:2].argmax(dim=-1).tolist()


def test_a_constrained_rows_drafts_are_cut_by_its_grammar_and_verified_under_its_mask(
) -> None:
    """Greedy rows under a regex, drafted for by prompt lookup: each draft is cut to what
    the grammar accepts, each drafted position verified under the grammar's mask there,
    and the text is the constrained text without speculation, drafts accepted among it."""
    model = tiny_gpt()
    params = SamplingParams(max_tokens=24, temperature=0.0,
                            constraint=Constraint.regex("[abc]{4,24}"))
    requests = [(prompt, params) for prompt in (PROMPTS[1], PROMPTS[3], PROMPTS[4])]
    plain = through_engine(engine_for(model, 3), requests, first=3)
    engine = engine_for(model, 3, num_speculative_tokens=4)
    drafted = through_engine(engine, requests, first=3)
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    assert all(set(r.text) <= set("abc") and len(r.text) >= 4 for r in drafted)
    assert engine.core.accepted > 0
