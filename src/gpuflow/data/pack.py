"""Convert a workload's data set into a packed set of shards (see ``gpuflow.data.shards``).

Text becomes token shards; every other workload's items, as its own readers produce them,
become tensor records. Memory stays bounded whatever the corpus: text is read from its
files a chunk at a time straight into the shard being written, and records one at a time
from lazy splits (the built-in image and audio readers' own, or a user workload's datasets
as given). Packing is resumable: each finished shard is recorded in a hidden state file as
soon as it is renamed into place, and a rerun with the same settings keeps the shards that
still match their checksums and continues after them. The manifest is written last, so a
folder with a manifest is a finished set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gpuflow.data.pack_progress import Mode, PackProgress
from gpuflow.data.shards import (
    EXAMPLE_FILE,
    FORMAT_VERSION,
    MANIFEST,
    PACK_STATE,
    Manifest,
    RecordShardWriter,
    ShardInfo,
    TokenShardWriter,
    encode_record,
    is_packed,
    layout_of,
    sha256_file,
    shard_name,
    write_manifest,
)
from gpuflow.data.text import READ_CHUNK, Span, SpanReader, split_spans
from gpuflow.errors import UserError

DEFAULT_SHARD_MB = 64
TOKEN_WORKLOADS = ("textlm",)
@dataclass(frozen=True)
class RecordSource:
    """What a record set is made of: indexable splits of items and an example batch."""

    workload: str
    splits: dict[str, Sequence[Any]]
    example: Any


# A workload's train/val items from its raw --data-dir (None: its default).
RecordsOf = Callable[[str, str | None], RecordSource]


@dataclass
class LabelTally:
    """The largest integer target packed so far, for ``meta["num_classes"]``; ``None``
    once a target is not an integer. Kept in the pack state, so a resumed pack knows the
    labels of the shards it keeps without reading them again (rewritten shards hold the
    same items, so counting one twice changes nothing)."""

    top: int | None = -1

    def add(self, item: Any) -> None:
        if self.top is None:
            return
        target = torch.as_tensor(item[1])
        self.top = (None if target.ndim != 0 or target.is_floating_point()
                    else max(self.top, int(target)))

    def meta(self) -> dict[str, Any]:
        return {"num_classes": self.top + 1} if self.top is not None and self.top >= 0 else {}


class PackState:
    """The shards finished so far, saved after each one, and the settings they belong to."""

    def __init__(self, out: Path, settings: dict[str, Any]) -> None:
        self.path = out / PACK_STATE
        self.settings = settings
        self.splits: dict[str, list[ShardInfo]] = {}
        self.labels = LabelTally()

    @classmethod
    def resume(cls, out: Path, settings: dict[str, Any]) -> PackState:
        """Keep, per split, the leading shards whose files still match their checksums."""
        state = cls(out, settings)
        if not state.path.is_file():
            return state
        saved = json.loads(state.path.read_text())
        if saved["settings"] != settings:
            raise UserError(
                f"--out {out} holds an unfinished pack made with other settings "
                f"({saved['settings']}). Rerun with those, or add --force to start over."
            )
        state.labels = LabelTally(saved.get("labels_top", -1))
        for split, shards in saved["splits"].items():
            kept = state.splits.setdefault(split, [])
            for shard in map(lambda s: ShardInfo(**s), shards):
                path = out / shard.file
                if (not path.is_file() or path.stat().st_size != shard.bytes
                        or sha256_file(path) != shard.sha256):
                    break
                kept.append(shard)
        return state

    def done(self, split: str) -> tuple[int, int]:
        """Records (or tokens) and shards of ``split`` finished so far."""
        shards = self.splits.get(split, [])
        return sum(shard.count for shard in shards), len(shards)

    def record(self, split: str, shard: ShardInfo) -> None:
        self.splits.setdefault(split, []).append(shard)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"settings": self.settings, "labels_top": self.labels.top,
                                   "splits": {name: [asdict(s) for s in shards]
                                              for name, shards in self.splits.items()}}))
        os.replace(tmp, self.path)


def _write_records(out: Path, split: str, items: Sequence[Any], state: PackState,
                   shard_bytes: int, progress: PackProgress) -> None:
    done, shards = state.done(split)
    progress.begin(split, len(items), "items", done, shards)
    writer: RecordShardWriter | None = None
    for index in range(done, len(items)):
        if writer is None:
            writer = RecordShardWriter(out / shard_name(split, len(state.splits.get(split, [])),
                                                        "records"))
        item = items[index]
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
        writer = TokenShardWriter(out / shard_name(split, shards, "tokens"), count)
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


def _prepare_out(out: Path, force: bool) -> None:
    """Refuse to overwrite a finished set or to write among foreign files."""
    if is_packed(out):
        if not force:
            raise UserError(f"--out {out} already holds a finished packed set; add --force to "
                            "pack it again.")
        old = json.loads((out / MANIFEST).read_text())
        listed = [s["file"] for split in old.get("splits", {}).values() for s in split]
        for name in [*listed, EXAMPLE_FILE, MANIFEST, PACK_STATE]:
            (out / name).unlink(missing_ok=True)
    elif force:
        (out / PACK_STATE).unlink(missing_ok=True)
    elif out.is_dir() and any(out.iterdir()) and not (out / PACK_STATE).is_file():
        raise UserError(f"--out {out} is not empty and holds no packed set; choose a new or "
                        "empty folder.")
    out.mkdir(parents=True, exist_ok=True)


def write_pack(workload: str, src: str | Path | None, out: str | Path, records_of: RecordsOf,
               shard_mb: float = DEFAULT_SHARD_MB, force: bool = False,
               progress: bool | Mode = True) -> Manifest:
    """Pack ``workload``'s data from ``src`` (its raw --data-dir; None: its default) into
    ``out``, continuing an interrupted pack of the same settings. Text is read here; any
    other workload's items come from ``records_of`` (``gpuflow.workloads.packing`` finds
    them by the workload's name). ``progress``: a live bar (True or "bar"), a line per
    shard ("lines"), or nothing (False or "off")."""
    out = Path(out)
    source = None if src is None else str(Path(src).resolve())
    if source is not None and is_packed(source):
        raise UserError(f"{src} is already a packed set; train from it with --data-dir.")
    shard_bytes = max(1, int(shard_mb * 2**20))
    kind = "tokens" if workload in TOKEN_WORKLOADS else "records"
    _prepare_out(out, force)
    settings = {"workload": workload, "source": source, "shard_bytes": shard_bytes,
                "format_version": FORMAT_VERSION}
    state = PackState.resume(out, settings)
    manifest = Manifest(workload=workload, kind=kind, splits={}, source=source,
                        shard_bytes=shard_bytes)
    mode: Mode = "bar" if progress is True else "off" if progress is False else progress
    with PackProgress(mode) as report:
        if kind == "tokens":
            for split, spans in split_spans(source).items():
                _write_tokens(out, split, spans, state, shard_bytes, report)
        else:
            records = records_of(workload, source)
            for split, items in records.splits.items():
                _write_records(out, split, items, state, shard_bytes, report)
            manifest.workload = records.workload
            manifest.layout = layout_of(records.splits["train"][0])
            manifest.example_layout = layout_of(records.example)
            manifest.meta = state.labels.meta()
            writer = RecordShardWriter(out / EXAMPLE_FILE)
            writer.write(encode_record(records.example))
            manifest.example = writer.close()
    manifest.splits = state.splits
    write_manifest(out, manifest)
    state.path.unlink()
    return manifest
