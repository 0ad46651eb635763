"""Where each step's time goes, measured honestly and written as it happens.

Regions per optimizer step: ``data_wait`` (blocked on the next batch), ``compute`` (forward
and backward), ``comm`` (communication inside forward and backward that compute did not
hide: DDP's after the last bucket, waits for collectives), ``optimizer`` (clip, step,
zero-grad, schedule) and ``host`` (the rest). On the CPU they are wall-clock intervals. On
CUDA, compute, comm and optimizer are timed with CUDA events, read only at log time, and the
step time is the wall clock of the logging window after a synchronize, so measuring never
serialises the GPU between steps.
"""

from __future__ import annotations

import contextlib
import json
import resource
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from gpuflow.errors import UserError
from gpuflow.storage import guarded

PER_STEP_FIELDS = ("step_time_s", "data_wait_s", "compute_s", "comm_s", "optimizer_s", "host_s",
                   "data_wait_frac", "comm_frac", "samples_per_s", "tokens_per_s",
                   "achieved_flops", "mfu")


class _Region:
    """Accumulates the duration of one region over a logging window."""

    def __init__(self, cuda_device: torch.device | None) -> None:
        self._cuda = cuda_device
        self.total_s = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: Any = None
        self.running = False

    def begin(self) -> None:
        self.running = True
        if self._cuda is None:
            self._start = time.perf_counter()
        else:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def end(self) -> None:
        self.running = False
        if self._cuda is None:
            self.total_s += time.perf_counter() - self._start
        else:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._pending.append((self._start, stop))

    def end_if_begun(self) -> None:
        """Close an interval only if one is open."""
        if self.running:
            self.end()

    def drain(self) -> float:
        """Seconds spent in this region since the last drain (needs a synchronized device)."""
        total = self.total_s + sum(a.elapsed_time(b) for a, b in self._pending) / 1e3
        self.total_s, self._pending = 0.0, []
        return total


@dataclass
class WindowStats:
    steps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    data_wait_s: float = 0.0
    real: Any = 0.0  # of padded inputs: elements that are data (a device tensor, summed)
    padded: int = 0  # and all elements


class StepTimer:
    """Times the regions of the training step over a logging window."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cuda = device if device.type == "cuda" else None
        self.compute = _Region(cuda)
        self.optimizer = _Region(cuda)
        self.comm = _Region(cuda)
        self.window = WindowStats()
        self._window_start = time.perf_counter()
        self._wait_start = 0.0

    @contextlib.contextmanager
    def exposed_comm(self) -> Iterator[None]:
        """Count a wait for a collective as exposed communication, when it runs inside a
        timed forward and backward and no outer wait already counts it.

        On the CPU a collective holds the host until it completes, so the host's time inside
        is the communication. On CUDA the wait only makes the compute stream wait for the
        collective's stream: events recorded on the compute stream around it measure how
        long that stream stalled, which is the communication compute did not hide.
        """
        if not self.compute.running or self.comm.running:
            yield
            return
        self.comm.begin()
        try:
            yield
        finally:
            self.comm.end()

    def start_window(self) -> None:
        """Begin timing from now (set-up before the first step is not a step)."""
        self._window_start = time.perf_counter()

    def wait_begin(self) -> None:
        self._wait_start = time.perf_counter()

    def wait_end(self) -> None:
        self.window.data_wait_s += time.perf_counter() - self._wait_start

    def count_padding(self, padding: Callable[[Any], tuple[Any, int]] | None,
                      inputs: Any) -> None:
        """Add a batch's real and padded elements, as the workload's ``padding`` counts
        them (none: nothing to count); summed on the device until the window closes."""
        if padding is not None:
            real, padded = padding(inputs)
            self.window.real, self.window.padded = self.window.real + real, \
                self.window.padded + padded

    def close_window(self) -> dict[str, float]:
        """Per-step averages over the window; synchronizes CUDA once."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        steps = max(1, self.window.steps)
        wall = now - self._window_start
        step_time = wall / steps
        data_wait = self.window.data_wait_s / steps
        comm = self.comm.drain() / steps
        compute = max(0.0, self.compute.drain() / steps - comm)
        optimizer = self.optimizer.drain() / steps
        result = {
            "step_time_s": step_time,
            "data_wait_s": data_wait,
            "compute_s": compute,
            "comm_s": comm,
            "optimizer_s": optimizer,
            "host_s": max(0.0, step_time - data_wait - compute - comm - optimizer),
            "data_wait_frac": min(1.0, data_wait / step_time) if step_time > 0 else 0.0,
            "comm_frac": min(1.0, comm / step_time) if step_time > 0 else 0.0,
            "samples_per_s": self.window.samples / wall if wall > 0 else 0.0,
            "loss": self.window.loss_sum / steps,
            "window_steps": self.window.steps,
        }
        if self.window.padded:
            result["padding_frac"] = 1.0 - float(self.window.real) / self.window.padded
        self.window = WindowStats()
        self._window_start = time.perf_counter()
        return result


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory and what it measures: CUDA allocator peak, or the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"


METRICS_ADVICE = ("Free some space or train into another --run-dir; --resume continues from "
                  "the newest checkpoint.")


@dataclass
class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (and to TensorBoard if asked)."""

    path: Path
    tensorboard_dir: Path | None = None
    enabled: bool = True
    records: list[dict[str, Any]] = field(default_factory=list)
    _handle: TextIO | None = None
    _writer: Any = None

    def open(self, keep_until_step: int | None) -> None:
        """Open for appending; on resume, drop records after the checkpoint's step (and a
        line that a full disk cut short)."""
        if not self.enabled:
            return
        with guarded(self.path, METRICS_ADVICE):
            if keep_until_step is not None and self.path.exists():
                kept = [record for record in _whole_records(self.path)
                        if record.get("step", 0) <= keep_until_step]
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps(record) + "\n" for record in kept))
                tmp.replace(self.path)
                self.records = kept
            elif keep_until_step is None and self.path.exists():
                self.path.unlink()
            self._handle = self.path.open("a")
        if self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._handle is None:
            return
        try:
            with guarded(self.path, METRICS_ADVICE):
                self._handle.write(json.dumps(record) + "\n")
                self._handle.flush()
        except UserError:
            with contextlib.suppress(OSError):  # what is left unflushed cannot be written
                self._handle.close()
            self._handle = None
            raise
        if self._writer is not None:
            prefix = "eval" if record.get("event") == "eval" else "train"
            for key, value in record.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
                    self._writer.add_scalar(f"{prefix}/{key}", value, record["step"])

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def step_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "event" not in r]

    def eval_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == "eval"]


def _whole_records(path: Path) -> list[dict[str, Any]]:
    """The records of ``path``, less a last line that was cut short."""
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            if line.strip():
                records.append(json.loads(line))
    return records


def medians(records: Iterable[dict[str, Any]], keys: Iterable[str] = PER_STEP_FIELDS
            ) -> dict[str, float | None]:
    """Median of each per-step figure across logged windows (nulls ignored)."""
    records = list(records)
    out: dict[str, float | None] = {}
    for key in keys:
        values = [r[key] for r in records if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out
