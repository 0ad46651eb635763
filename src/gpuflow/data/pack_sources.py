"""What a packed set is made of, and how each kind of source writes its shards.

A workload hands the packer one of these (``gpuflow.workloads.packing`` finds which): the
source decides the set's kind, so the packer never asks what the workload is. Each source
writes its splits shard by shard, recording every finished shard in the pack state, and
describes the set for the manifest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuflow.data.kinds import TensorRecords, TokenWindows
from gpuflow.data.manifest import EXAMPLE_FILE, Manifest
from gpuflow.data.pack_progress import PackProgress
from gpuflow.data.pack_state import PackState
from gpuflow.data.record_codec import encode_record, layout_of
from gpuflow.data.shard_files import RecordShardWriter, TokenShardWriter
from gpuflow.data.text import READ_CHUNK, Span, SpanReader
from gpuflow.errors import UserError


class PackSource(Protocol):
    """The data of one workload, ready to be written as shards."""

    workload: str

    def pack(self, out: Path, state: PackState, shard_bytes: int,
             progress: PackProgress) -> Manifest:
        """Write every split into ``out`` (continuing after ``state``'s shards) and
        describe the set; the manifest's splits are ``state.splits``."""
        ...


@dataclass(frozen=True)
class RecordSource:
    """A record set: indexable splits of items (read one at a time) and an example batch."""

    workload: str
    splits: dict[str, Sequence[Any]]
    example: Any

    def pack(self, out: Path, state: PackState, shard_bytes: int,
             progress: PackProgress) -> Manifest:
        for split, items in self.splits.items():
            done, shards = state.done(split)
            progress.begin(split, len(items), "items", done, shards)
            write_records(out, split, (items[i] for i in range(done, len(items))), state,
                          shard_bytes, progress)
        return record_manifest(out, self.workload, state, self.splits["train"][0],
                               self.example)


def record_manifest(out: Path, workload: str, state: PackState, item: Any,
                    example: Any) -> Manifest:
    """A record set's manifest once its splits are written: the layout of ``item`` (one
    of them) and the ``example`` batch, written beside the shards."""
    writer = RecordShardWriter(out / EXAMPLE_FILE)
    writer.write(encode_record(example))
    return Manifest(workload=workload, kind=TensorRecords.name, splits=state.splits,
                    layout=layout_of(item), example=writer.close(),
                    example_layout=layout_of(example), meta=state.labels.meta())


def write_records(out: Path, split: str, items: Iterable[Any], state: PackState,
                  shard_bytes: int, progress: PackProgress) -> None:
    """The records of ``split`` after its finished shards (``items`` starts there), into
    shards of about ``shard_bytes``, each recorded in ``state`` as it closes; ``progress``
    has begun the split."""
    writer: RecordShardWriter | None = None
    for item in items:
        if writer is None:
            number = len(state.splits.get(split, []))
            writer = RecordShardWriter(out / TensorRecords.shard_name(split, number))
        record = encode_record(item)
        state.labels.add(item)
        writer.write(record)
        progress.advance(len(record), 1)
        if writer.size >= shard_bytes:
            state.record(split, writer.close())
            progress.shard_written()
            writer = None
    if writer is not None:
        state.record(split, writer.close())
        progress.shard_written()


@dataclass(frozen=True)
class TokenSource:
    """A byte-level token set: each split's bytes as spans of files, one token per byte."""

    workload: str
    splits: dict[str, list[Span]]

    def pack(self, out: Path, state: PackState, shard_bytes: int,
             progress: PackProgress) -> Manifest:
        for split, spans in self.splits.items():
            _write_tokens(out, split, spans, state, shard_bytes, progress)
        return Manifest(workload=self.workload, kind=TokenWindows.name, splits=state.splits)


def _write_tokens(out: Path, split: str, spans: list[Span], state: PackState,
                  shard_bytes: int, progress: PackProgress) -> None:
    """Shards of ``shard_bytes`` tokens cut from the split's bytes, read a chunk at a time:
    a shard's length is known before it is read, so its header is written first and its
    tokens go straight to the file."""
    total = sum(span.size for span in spans)
    done, shards = state.done(split)
    progress.begin(split, total, "bytes", done, shards)
    reader = SpanReader(spans, done)
    for start in range(done, total, shard_bytes):
        count = min(shard_bytes, total - start)
        writer = TokenShardWriter(out / TokenWindows.shard_name(split, shards), count)
        while writer.written < count:
            chunk = reader.read(min(READ_CHUNK, count - writer.written))
            if not chunk:
                raise UserError(f"The text being packed got shorter while it was read; pack "
                                f"it again when it is no longer written to ({split} split).")
            writer.write(chunk)
            progress.advance(len(chunk), len(chunk))
        state.record(split, writer.close())
        progress.shard_written()
        shards += 1
