"""A disk that fills up or stalls, without root: Python's file opens under a folder are
wrapped so that writes past a byte budget fail with ENOSPC partway through a file, and
``shutil.disk_usage`` reports the budget that is left (or, stale, plenty).

Used in-process by ``install``, or in a training subprocess through the ``paced_mlp``
workload, which reads the same settings from the environment (``FULL_DISK_*``); with the
checks that tests/test_full_disk.py and tests/test_preemption.py share."""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from user_workloads import mlp

import gpuflow
from gpuflow import checkpoint as ckpt

PLENTY = 1 << 40


class FullDisk:
    """``budget`` more bytes fit under ``root`` (once ``after`` exists, if given). Opening a
    file named ``slow_file`` there for writing creates ``slow_marker`` and stalls 1 s: a slow
    save, for a test to signal during it."""

    def __init__(self, root: Path, budget: int, after: Path | None = None,
                 stale_free: bool = False, slow_file: str | None = None,
                 slow_marker: Path | None = None) -> None:
        self.root, self.left, self.after = root.resolve(), budget, after
        self.stale_free, self.slow_file, self.slow_marker = stale_free, slow_file, slow_marker

    def active(self) -> bool:
        return self.after is None or self.after.exists()

    def covers(self, path: Any) -> bool:
        try:
            return Path(os.fspath(path)).resolve().is_relative_to(self.root)
        except TypeError:
            return False

    def charge(self, wanted: int) -> int:
        """Bytes of a ``wanted``-byte write that fit."""
        if not self.active():
            return wanted
        fits = min(wanted, max(self.left, 0))
        self.left -= fits
        return fits

    def free(self) -> int:
        return PLENTY if self.stale_free or not self.active() else max(self.left, 0)


class _Writer:
    """A file (binary or text) whose writes draw on the disk's budget: the part of a write
    that fits is written, then ENOSPC."""

    def __init__(self, handle: Any, disk: FullDisk, name: str) -> None:
        self.handle, self.disk, self.name = handle, disk, name

    def write(self, data: Any) -> int:
        if not isinstance(data, str):
            data = memoryview(data).cast("B")
        fits = self.disk.charge(len(data))
        if fits < len(data):
            self.handle.write(data[:fits])
            self.handle.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        return self.handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


def install(disk: FullDisk, patch: Callable[[Any, str, Any], None]) -> None:
    """Route opens for writing under ``disk.root`` and its free-space figure through
    ``disk``; ``patch(owner, name, value)`` sets an attribute (``monkeypatch.setattr``)."""
    real_open, real_usage = io.open, shutil.disk_usage

    def fault_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        if not any(m in mode for m in "wax+") or not disk.covers(file):
            return handle
        name = os.fspath(file)
        if disk.slow_file and Path(name).name == disk.slow_file and disk.slow_marker:
            disk.slow_marker.touch()
            time.sleep(1.0)
        return _Writer(handle, disk, name)

    def usage(path: Any) -> Any:
        real = real_usage(path)
        if not disk.covers(path):
            return real
        return type(real)(real.total, real.total - disk.free(), disk.free())

    patch(builtins, "open", fault_open)
    patch(io, "open", fault_open)
    patch(shutil, "disk_usage", usage)


def _from_environment() -> None:
    """Install the disk that ``FULL_DISK_*`` describe, in this rank if FULL_DISK_RANK says
    which, on the first attempt only (an elastic restart writes normally)."""
    root = os.environ.get("FULL_DISK_ROOT")
    rank = os.environ.get("FULL_DISK_RANK")
    if root is None or (rank is not None and os.environ.get("RANK", "0") != rank):
        return
    after = os.environ.get("FULL_DISK_AFTER")
    marker = os.environ.get("SLOW_SAVE_MARKER")
    disk = FullDisk(Path(root), int(os.environ.get("FULL_DISK_BYTES", PLENTY)),
                    Path(after) if after else None,
                    stale_free=os.environ.get("FULL_DISK_STALE_FREE") == "1",
                    slow_file=os.environ.get("SLOW_SAVE_FILE"),
                    slow_marker=Path(marker) if marker else None)
    install(disk, setattr)


def assert_earlier_checkpoints_intact(directory: Path, steps: list[int]) -> None:
    """The listed checkpoints and nothing else, each verified and loaded; no temporary
    folder."""
    assert [c.step for c in ckpt.list_checkpoints(directory)] == steps
    assert not list(directory.glob(".tmp-*"))
    for checkpoint in ckpt.list_checkpoints(directory):
        ckpt.verify_checkpoint(checkpoint)
        assert ckpt.load_checkpoint(checkpoint)[1]["step"] == checkpoint.step


def assert_clear_message(message: str, path: str, *advice: str) -> None:
    assert "No space left on the disk holding" in message and path in message, message
    assert "free" in message and "bytes" in message, message
    for flag in advice:
        assert flag in message, message
    assert "Traceback" not in message


class PacedDataset(Dataset):
    """Takes $PACE_S seconds per sample, so that a test can signal a run mid-way."""

    def __init__(self, base: Dataset) -> None:
        self.base, self.pace = base, float(os.environ.get("PACE_S", "0"))

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.pace)
        return self.base[index]


def cli_here(*argv: str) -> int:
    """`gpuflow ARGV` in this process (no start-up to pay), its torch threads put back
    after it (the paced workload runs on one)."""
    from gpuflow.cli import main

    threads = torch.get_num_threads()
    try:
        return main(list(argv))
    finally:
        torch.set_num_threads(threads)


def paced_mlp() -> gpuflow.Workload:
    """The tiny MLP, paced by $PACE_S, on the disk that $FULL_DISK_* describe; each rank
    writes its pid to $PID_DIR/rank<RANK>-<attempt>.pid for a test to signal it."""
    _from_environment()
    pid_dir = os.environ.get("PID_DIR")
    if pid_dir:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        path = Path(pid_dir) / f"rank{os.environ.get('RANK', '0')}-{attempt}.pid"
        path.write_text(str(os.getpid()))
    workload = mlp()
    workload.example_batch = workload.collate([workload.train_dataset[i] for i in range(8)])
    workload.train_dataset = PacedDataset(workload.train_dataset)
    torch.set_num_threads(1)
    return workload
