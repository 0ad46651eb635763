"""A CPU run takes the cores other work leaves idle as its intra-op threads."""

from __future__ import annotations

import time

import pytest
import torch

from gpuflow.parallel import env


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_idle_cores_all_become_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "usable_cores", lambda: 4)
    monkeypatch.setattr(env, "busy_cores", lambda: 0.3)
    assert env.set_cpu_threads() is None
    assert torch.get_num_threads() == 4


def test_busy_cores_are_left_to_their_work_and_the_run_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "usable_cores", lambda: 4)
    monkeypatch.setattr(env, "busy_cores", lambda: 2.6)
    note = env.set_cpu_threads()
    assert torch.get_num_threads() == 1
    assert note is not None and "3 of 4 cores busy" in note and "OMP_NUM_THREADS" in note
    monkeypatch.setattr(env, "busy_cores", lambda: 9.0)
    env.set_cpu_threads()
    assert torch.get_num_threads() == 1  # never fewer than one


def test_ranks_of_one_job_share_the_cores_by_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "usable_cores", lambda: 8)
    monkeypatch.setattr(env, "busy_cores", lambda: 5.0)  # siblings starting up
    assert env.set_cpu_threads(processes_on_node=2) is None
    assert torch.get_num_threads() == 4


def test_busy_cores_sees_a_spinning_thread_of_this_process() -> None:
    """/proc/stat counts every process, this one's spinning thread included."""
    import threading

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    try:
        time.sleep(0.05)
        busy = env.busy_cores(window_s=0.3)
    finally:
        stop.set()
        worker.join()
    assert busy >= 0.5
