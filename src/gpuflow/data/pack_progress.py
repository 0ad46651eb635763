"""What `gpuflow data pack` reports as it goes: bytes read, shards written, rate and ETA.

On a terminal it is a live bar per split; elsewhere (a log, a CI job) one line per shard
written, so a long pack is never silent.
"""

from __future__ import annotations

import sys
import time
from typing import Literal, TextIO

from rich.progress import BarColumn, Progress, TextColumn

Mode = Literal["bar", "lines", "off"]
MIB = 2**20


class PackProgress:
    """One split at a time: the bytes read and shards written by this run, and how far
    through the split it is in ``unit`` (bytes for text, whose size the files give; items
    for records, whose count the dataset's length gives; a total of ``None`` when only
    the stream's end tells it, e.g. windows packed as conversations arrive)."""

    def __init__(self, mode: Mode, stream: TextIO | None = None) -> None:
        self.mode = mode
        self._stream = stream or sys.stderr
        self._bar = (Progress(TextColumn("{task.description}"), BarColumn(),
                              TextColumn("{task.fields[status]}"))
                     if mode == "bar" else None)
        self._task: int | None = None
        self.split, self.unit = "", "bytes"
        self.total: int | None = 0
        self.position = self._start = 0
        self.read = self.shards = 0
        self._started = time.perf_counter()

    def __enter__(self) -> PackProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def begin(self, split: str, total: int | None, unit: str, done: int,
              shards: int) -> None:
        """A split starts, ``done`` units and ``shards`` shards in (kept by a resumed pack)."""
        self.split, self.total, self.unit = split, total, unit
        self.position = self._start = done
        self.read, self.shards = 0, shards
        self._started = time.perf_counter()
        if self._bar is not None:
            self._task = self._bar.add_task(split, total=total, completed=done,
                                            status=self.describe())

    def advance(self, nbytes: int, units: int) -> None:
        self.read += nbytes
        self.position += units
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.position, status=self.describe())

    def shard_written(self) -> None:
        self.shards += 1
        if self.mode == "lines":
            print(f"pack {self.split}: {self.describe()}", file=self._stream, flush=True)
        elif self._bar is not None and self._task is not None:
            self._bar.update(self._task, status=self.describe())

    def describe(self) -> str:
        """E.g. '1,536.0 MiB read, 24 shards written, 85.2 MiB/s, 40% of 3.8 GiB, ETA 12 s'."""
        elapsed = time.perf_counter() - self._started
        rate = self.read / MIB / elapsed if elapsed > 0 else 0.0
        moved = self.position - self._start
        done = (f"{self.read / MIB:,.1f} MiB read, {self.shards} shards written, "
                f"{rate:,.1f} MiB/s")
        if self.total is None:
            return f"{done}, {self.position:,} {self.unit} so far"
        eta = (f"{(self.total - self.position) * elapsed / moved:.0f} s" if moved > 0
               else "unknown")
        share = self.position / self.total if self.total else 1.0
        whole = (f"{self.total / MIB:,.1f} MiB" if self.unit == "bytes"
                 else f"{self.total:,} items")
        return f"{done}, {share:.0%} of {whole}, ETA {eta}"
