"""Preemption: SIGTERM or SIGUSR1 stops a run after the step in progress, with a checkpoint
at that step and exit code 75; resumed, the run ends on the same weights, bit for bit."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, cli_env, run_cli
from disk_faults import assert_clear_message, assert_earlier_checkpoints_intact, cli_here
from runs import events, step_records

from gpuflow import checkpoint as ckpt
from gpuflow.config import build_config
from gpuflow.errors import EXIT_PREEMPTED, UserError
from gpuflow.parallel.launch import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    SHUTDOWN_TIMEOUT_ENV,
    LaunchSpec,
    launch,
)
from gpuflow.train.preemption import Preemption

TOTAL_STEPS = 30
# 5 ms a sample, 16 samples a batch: steps of about 80 ms, long enough to signal mid-run.
PACE_S = "0.005"
PACED = ["train", "--workload", "disk_faults:paced_mlp", "--schedule", "constant",
         "--warmup-steps", "0", "--log-every", "1", "--eval-every", "0", "--no-progress",
         "--batch-size", "16", "--max-steps", str(TOTAL_STEPS)]
DRAW = random.Random(42)  # "a random step", reproducible from run to run


def test_the_handler_notes_a_signal_and_the_flag_rides_on_the_loss() -> None:
    preemption = Preemption(enabled=True)
    before = signal.getsignal(signal.SIGUSR1)
    identity = lambda loss: loss  # noqa: E731 (one process: the mean is the loss)
    with preemption.handling():
        assert preemption.mean_loss(identity, torch.tensor(0.25)) == 0.25
        assert not preemption.stop_agreed
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert preemption.received == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
        time.sleep(0.01)
        assert preemption.received == signal.SIGUSR1
        assert preemption.mean_loss(identity, torch.tensor(0.25)) == 0.25
        assert preemption.stop_agreed
    assert signal.getsignal(signal.SIGUSR1) is before


def test_no_save_on_signal_leaves_the_signals_alone() -> None:
    assert build_config({}, {"save_on_signal": False}).save_on_signal is False
    preemption = Preemption(enabled=False)
    before = signal.getsignal(signal.SIGTERM)
    with preemption.handling():
        assert signal.getsignal(signal.SIGTERM) is before


def test_the_agent_gives_signalled_workers_time_to_save(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's agent SIGKILLs its workers 30 s after passing a signal on, unless told
    otherwise: shorter than a large save (docs/checkpoints.md's table)."""
    import torch.distributed.launcher.api as elastic

    given: list[int | None] = []
    monkeypatch.setattr(elastic, "elastic_launch", lambda config, entrypoint: (
        lambda *argv: given.append(config.shutdown_timeout)))
    monkeypatch.delenv(SHUTDOWN_TIMEOUT_ENV, raising=False)
    launch(LaunchSpec(nproc=2), ["train"])
    monkeypatch.setenv(SHUTDOWN_TIMEOUT_ENV, "45")
    launch(LaunchSpec(nproc=2), ["train"])
    assert given == [DEFAULT_SHUTDOWN_TIMEOUT_S, 45] and DEFAULT_SHUTDOWN_TIMEOUT_S >= 120
    monkeypatch.setenv(SHUTDOWN_TIMEOUT_ENV, "2m")
    with pytest.raises(UserError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT='2m' is not a whole"):
        launch(LaunchSpec(nproc=2), ["train"])


# Loaders of both kinds with workers, a SIGTERM to every worker from another process (as a
# scheduler signals the process group), batches still flowing, then an error raised with the
# loaders still referenced: the interpreter's exit must stop the workers, not wait on them.
LOADERS_THEN_AN_ERROR = """
import multiprocessing, subprocess, torch
from torch.utils.data import TensorDataset
from gpuflow.data.eval_set import eval_set
from gpuflow.data.loader import train_batches
data = TensorDataset(torch.arange(256.0).unsqueeze(1))
train = iter(train_batches(data, 8, None, 0, 0, num_workers=2, pin_memory=False))
evaluation = iter(eval_set(data, 8, 0).loader(None, num_workers=1, pin_memory=False))
next(train), next(evaluation)
workers = [str(child.pid) for child in multiprocessing.active_children()]
subprocess.run(["kill", "-TERM", *workers], check=True)
print(len(workers), sum(1 for _ in zip(range(40), train)), sum(1 for _ in evaluation))
raise RuntimeError("the run failed mid-iteration")
"""


def test_loader_workers_outlive_a_stop_signal_but_not_their_trainer(tmp_path: Path) -> None:
    """Before: the train loader's workers ignored every SIGTERM, so an error with a loader
    alive at exit hung the interpreter in multiprocessing's join() (the suite's CI hang),
    and the eval loader's worker died of the signal."""
    process = subprocess.run([sys.executable, "-c", LOADERS_THEN_AN_ERROR], cwd=tmp_path,
                             env=cli_env(), capture_output=True, text=True, timeout=60)
    assert process.returncode == 1, process.stderr[-3000:]
    assert "RuntimeError: the run failed mid-iteration" in process.stderr
    assert process.stdout.split() == ["3", "40", "31"]


def start(run_dir: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    """`gpuflow train` in its own process group, as a scheduler's job step runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpuflow.cli", *PACED, "--run-dir", str(run_dir), *args],
        cwd=ROOT, env=cli_env(PACE_S=PACE_S, **env), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)


def logged_step(run_dir: Path) -> int:
    """The newest step in metrics.jsonl (a line being written is not yet one)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in lines
             if line.startswith('{"step": ')]
    return max(steps, default=0)


def wait_until(condition, process: subprocess.Popen[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def finished(process: subprocess.Popen[str], code: int) -> str:
    try:
        _, err = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == code, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    return err


def assert_stopped_within(run_dir: Path, before: int, after: int) -> int:
    """The run stopped after the step in progress when it was signalled (logged ``before``
    the signal, at most ``after`` just after it), with a checkpoint at that step."""
    stop = events(run_dir, "preempted")[-1]["step"]
    assert before < stop <= after + 2, (before, stop, after)
    newest = ckpt.latest_verified(run_dir / "checkpoints")
    assert newest is not None and newest.step == stop
    return stop


def interrupt(run_dir: Path, sig: signal.Signals, *args: str, during_save: Path | None = None,
              **env: str) -> int:
    """Signal the whole process group at a drawn step, and once more during the save if
    ``during_save`` (a file the slowed save creates) is given; the step it stopped at."""
    at = DRAW.randint(logged_step(run_dir) + 3, logged_step(run_dir) + 10)
    process = start(run_dir, *args, **env)
    wait_until(lambda: logged_step(run_dir) >= at, process)
    before = logged_step(run_dir)
    os.killpg(process.pid, sig)
    after = logged_step(run_dir)
    if during_save is not None:
        wait_until(during_save.exists, process)
        os.killpg(process.pid, sig)
    err = finished(process, EXIT_PREEMPTED)
    assert f"stopped by {sig.name}" in err and "Exit code 75" in err
    stop = assert_stopped_within(run_dir, before, after)
    assert step_records(run_dir)[-1]["step"] == stop  # nothing trained after it
    return stop


def model_at(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    found = [c for c in ckpt.list_checkpoints(run_dir / "checkpoints") if c.step == step]
    return ckpt.load_checkpoint(found[0])[0]


def assert_identical(measured: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
                     ) -> None:
    assert measured.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(measured[name], tensor), name


@pytest.mark.slow
def test_one_process_stops_on_either_signal_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert cli_here(*PACED, "--run-dir", str(reference), "--checkpoint-every", "1",
                    "--keep-checkpoints", str(TOTAL_STEPS)) == 0
    run_dir, saving = tmp_path / "run", tmp_path / "saving"
    # SIGTERM to the process group, as Slurm signals a job step: the loader's worker
    # ignores it; a second SIGTERM arrives while the checkpoint is written (slowed by 1 s).
    first = interrupt(run_dir, signal.SIGTERM, "--num-workers", "1", during_save=saving,
                      FULL_DISK_ROOT=str(run_dir), SLOW_SAVE_FILE=ckpt.TRAINER_FILE,
                      SLOW_SAVE_MARKER=str(saving))
    second = interrupt(run_dir, signal.SIGUSR1, "--resume")
    assert first < second < TOTAL_STEPS
    assert [e["step"] for e in events(run_dir, "preempted")] == [first, second]
    assert [r["step"] for r in step_records(run_dir)] == list(range(1, second + 1))
    # Resumed from the first stop, the run reached the second on the same weights.
    for step in (first, second):
        assert_identical(model_at(run_dir, step), model_at(reference, step))


@pytest.mark.slow
def test_two_fsdp_ranks_stop_together_restart_under_the_agent_and_match(
        tmp_path: Path) -> None:
    """One launch: SIGTERM to rank 1 alone (both ranks stop at the same step, the agent
    restarts them, they resume from that checkpoint), then SIGUSR1 to the agent, which
    passes it on; the launcher exits 75. The weights then match an uninterrupted run's.

    That reference run, a second launch, also fills rank 1's disk during the checkpoint
    after the one compared: the save fails on both ranks (exit 2) and the compared one
    stays the newest."""
    run_dir, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    two_ranks = ["--nproc", "2", "--strategy", "fsdp", "--batch-size", "8"]
    process = start(run_dir, *two_ranks, "--max-restarts", "1", PID_DIR=str(pids))
    at = DRAW.randint(3, 8)
    wait_until(lambda: logged_step(run_dir) >= at, process)
    before = logged_step(run_dir)
    os.kill(int((pids / "rank1-0.pid").read_text()), signal.SIGTERM)
    after = logged_step(run_dir)
    wait_until(lambda: (pids / "rank0-1.pid").exists(), process)
    wait_until(lambda: len(events(run_dir, "preempted")) == 1
               and logged_step(run_dir) > events(run_dir, "preempted")[0]["step"] + 3, process)
    first = assert_stopped_within(run_dir, before, after)
    before = logged_step(run_dir)
    process.send_signal(signal.SIGUSR1)
    after = logged_step(run_dir)
    err = finished(process, EXIT_PREEMPTED)
    second = assert_stopped_within(run_dir, before, after)
    assert "got SIGUSR1" in err
    stops = events(run_dir, "preempted")
    assert [(e["step"], e["signal"]) for e in stops] == [
        (first, "a signal to another rank"), (second, "SIGUSR1")]
    assert [r["step"] for r in step_records(run_dir)] == list(range(1, second + 1))
    reference = tmp_path / "reference"
    checkpoints = reference / "checkpoints"
    full_after = cli_env(PACE_S="0", FULL_DISK_ROOT=str(checkpoints), FULL_DISK_BYTES="1000",
                         FULL_DISK_STALE_FREE="1", FULL_DISK_RANK="1",
                         FULL_DISK_AFTER=str(checkpoints / f"step-{second:08d}"))
    result = run_cli(*PACED, *two_ranks, "--run-dir", str(reference), "--checkpoint-every",
                     str(second), "--max-steps", str(2 * second), env=full_after)
    assert result.returncode == 2, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: error: No space left on the disk holding" in result.stderr
    assert_clear_message(result.stderr, f"step-{2 * second:08d}", "--keep-checkpoints")
    assert_earlier_checkpoints_intact(checkpoints, [second])
    assert_identical(model_at(run_dir, second), model_at(reference, second))
