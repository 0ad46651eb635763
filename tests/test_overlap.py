"""Greedy steps left in flight (``serve/generate/launch.py``): the next step is planned and
launched over their tokens still on the device, and nothing a request sees changes."""

from __future__ import annotations

import time

import pytest
import torch
from generation import greedy_text, through_engine
from test_generate import engine_for, tiny_gpt

from gpuflow.serve.generate import build
from gpuflow.serve.generate.sampling import SamplingParams

PROMPTS = [b"def f(x):", b"import torch", b"a", b"The quick brown fox", b"class E:\n  ",
           b"0123456789", b"xy", b"while True:"]


def requests(stop: str) -> list[tuple[bytes, SamplingParams]]:
    """Greedy rows (left in flight) beside rows whose steps are waited for: sampled with a
    seed, with log-probabilities, with penalties; a stop string the second request meets;
    budgets that end at different steps."""
    asks = [SamplingParams(max_tokens=14, temperature=0.0),
            SamplingParams(max_tokens=9, temperature=0.0, stop=(stop,)),
            SamplingParams(max_tokens=20, temperature=0.8, seed=3),
            SamplingParams(max_tokens=7, temperature=0.0, logprobs=2),
            SamplingParams(max_tokens=16, temperature=0.0),
            SamplingParams(max_tokens=5, temperature=0.0, repetition_penalty=1.3),
            SamplingParams(max_tokens=18, temperature=0.0),
            SamplingParams(max_tokens=11, temperature=0.0, stop=("e",))]
    return list(zip(PROMPTS, asks, strict=True))


@pytest.mark.parametrize("setup", [{}, {"num_blocks": 12, "block_size": 4}],
                         ids=["plenty", "preempting"])
def test_steps_left_in_flight_change_nothing_a_request_sees(setup: dict[str, int]) -> None:
    model = tiny_gpt()
    stop = greedy_text(model, PROMPTS[1], 9)[:3]  # met at the third token
    found = {}
    for overlap in (True, False):
        engine = engine_for(model, 4, **setup)
        engine.core.overlap = overlap
        found[overlap] = through_engine(engine, requests(stop), first=5)
    assert found[True] == found[False]
    assert found[True][1].done.finish_reason == "stop"


def test_the_next_step_launches_before_the_last_ones_tokens_are_taken() -> None:
    """A forward that releases the GIL for 50 ms (as a GPU step would): the second step is
    launched while the first is still computing, and the first's tokens are taken after."""
    model = tiny_gpt()
    engine = engine_for(model, 2)
    core, events = engine.core, []
    core.overlap = True  # as where the forward has a core of its own (steps_overlap)
    run, launch, advance = core.runner.run_flat, core._launch, core._advance

    def slow_run(rows, patch=None):
        time.sleep(0.05)
        logits = run(rows, patch)
        events.append("computed")
        return logits

    def recorded_launch(plan):
        events.append("launched")
        return launch(plan)

    def recorded_advance(request, token, logits):
        events.append("taken")
        return advance(request, token, logits)

    core.runner.run_flat, core._launch, core._advance = (slow_run, recorded_launch,
                                                         recorded_advance)
    [(text, tokens, _)] = through_engine(
        engine, [(b"abc", SamplingParams(max_tokens=6, temperature=0.0))], first=1)
    assert events[:4] == ["launched", "launched", "computed", "taken"]
    assert text == greedy_text(model, b"abc", 6) and len(tokens) == 6


def test_steps_overlap_where_the_forward_has_a_core_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In flight on an accelerator, or on a CPU with a core beyond torch's threads; not on
    a CPU whose cores torch's threads take (a server pinned to one core, one thread)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert build.steps_overlap(torch.device("cpu"))
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert not build.steps_overlap(torch.device("cpu"))
    assert build.steps_overlap(torch.device("meta"))  # any device but the CPU
