"""CUDA-graph tree state in threads other than the importing one (torch 2.11's bare assert,
which made the generation engine decode without graphs on the H200), reproduced on the CPU
by torch 2.11's own lookup."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._inductor import cudagraph_trees

from gpuflow.graph_threads import prepare_thread_for_cuda_graphs
from gpuflow.serve.generate.runner import failure_text


def torch_2_11_get_obj(local: Any, attr_name: str) -> Any:
    """``cudagraph_trees.get_obj`` as torch 2.11 has it: no state set up for a new thread."""
    if hasattr(local, attr_name):
        return getattr(local, attr_name)
    if not torch._C._is_key_in_tls(attr_name):
        raise AssertionError  # torch's bare assert (pytest would rewrite one written here)
    return torch._C._get_obj_in_tls(attr_name)


def in_new_thread(work: Callable[[], Any]) -> Any:
    """``work()``'s result, or the exception it raised, in a thread of its own."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except Exception as exc:  # returned to the test to assert on
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return outcome[0]


def test_a_new_thread_gets_its_own_graph_trees_on_torch_2_11(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudagraph_trees, "get_obj", torch_2_11_get_obj)

    unprepared = in_new_thread(lambda: cudagraph_trees.get_container(0))
    assert isinstance(unprepared, AssertionError) and str(unprepared) == ""

    def prepared() -> tuple[Any, Any]:
        prepare_thread_for_cuda_graphs()
        prepare_thread_for_cuda_graphs()  # idempotent: the same state
        return cudagraph_trees.get_container(0), cudagraph_trees.get_container(0)

    first, again = in_new_thread(prepared)
    assert isinstance(first, cudagraph_trees.TreeManagerContainer) and first is again
    # Its own: the main thread's containers are not the new thread's.
    other, _ = in_new_thread(prepared)
    assert other is not first


def test_a_failure_without_a_message_says_where_it_was_raised() -> None:
    def bare_assert() -> None:
        raise AssertionError

    try:
        bare_assert()
    except AssertionError as exc:
        assert failure_text(exc).startswith("AssertionError: at test_graph_threads.py:")
        assert failure_text(exc).endswith("(bare_assert)")
    assert failure_text(ValueError("bad shape")) == "ValueError: bad shape"
