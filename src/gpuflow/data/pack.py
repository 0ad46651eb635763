"""Convert a workload's data set into a packed set of shards (see ``gpuflow.data.shards``).

Text becomes token shards; every other workload's items, as its own readers produce them,
become tensor records. Packing is resumable: each finished shard is recorded in a hidden
state file as soon as it is renamed into place, and a rerun with the same settings keeps
the shards that still match their checksums and continues after them. The manifest is
written last, so a folder with a manifest is a finished set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from gpuflow.data.shards import (
    EXAMPLE_FILE,
    FORMAT_VERSION,
    MANIFEST,
    PACK_STATE,
    Manifest,
    RecordShardWriter,
    ShardInfo,
    encode_record,
    is_packed,
    layout_of,
    sha256_file,
    shard_name,
    write_manifest,
    write_token_shard,
)
from gpuflow.errors import UserError

DEFAULT_SHARD_MB = 64
TOKEN_WORKLOADS = ("textlm",)


@dataclass(frozen=True)
class RecordSource:
    """What a record set is made of: indexable splits of items and an example batch."""

    workload: str
    splits: dict[str, Sequence[Any]]
    example: Any
    meta: dict[str, Any]


def workload_records(workload: str, src: str | None) -> RecordSource:
    """A workload's own train/val datasets, read by its raw readers from ``src``."""
    from gpuflow.workload import resolve_workload

    built = resolve_workload(workload, {} if src is None else {"data_dir": src})
    splits: dict[str, Sequence[Any]] = {"train": built.train_dataset}  # type: ignore[dict-item]
    if built.val_dataset is not None:
        splits["val"] = built.val_dataset  # type: ignore[assignment]
    return RecordSource(built.name, splits, built.get_example_batch(),
                        class_count(splits.values()))


def class_count(splits: Any) -> dict[str, Any]:
    """``{"num_classes": max label + 1}`` when every target is an integer, else nothing."""
    top = -1
    for split in splits:
        for index in range(len(split)):
            target = torch.as_tensor(split[index][1])
            if target.ndim != 0 or target.is_floating_point():
                return {}
            top = max(top, int(target))
    return {"num_classes": top + 1} if top >= 0 else {}


def text_tokens(src: str | None) -> dict[str, bytes]:
    """Byte-level text split by document, exactly as the textlm workload splits it."""
    from gpuflow.data.text import load_split

    split = load_split(src)
    return {"train": split.train, "val": split.val}


class PackState:
    """The shards finished so far, saved after each one, and the settings they belong to."""

    def __init__(self, out: Path, settings: dict[str, Any]) -> None:
        self.path = out / PACK_STATE
        self.settings = settings
        self.splits: dict[str, list[ShardInfo]] = {}

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
        for split, shards in saved["splits"].items():
            kept = state.splits.setdefault(split, [])
            for shard in map(lambda s: ShardInfo(**s), shards):
                path = out / shard.file
                if (not path.is_file() or path.stat().st_size != shard.bytes
                        or sha256_file(path) != shard.sha256):
                    break
                kept.append(shard)
        return state

    def record(self, split: str, shard: ShardInfo) -> None:
        self.splits.setdefault(split, []).append(shard)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"settings": self.settings, "splits": {
            name: [asdict(s) for s in shards] for name, shards in self.splits.items()}}))
        os.replace(tmp, self.path)


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Progress]:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[unit]}"), TimeRemainingColumn())
    with Progress(*columns, disable=not enabled) as progress:
        yield progress


def _write_records(out: Path, split: str, items: Sequence[Any], state: PackState,
                   shard_bytes: int, progress: Progress) -> None:
    done = sum(shard.count for shard in state.splits.get(split, []))
    task = progress.add_task(f"{split}", total=len(items), completed=done, unit="samples")
    writer: RecordShardWriter | None = None
    for index in range(done, len(items)):
        if writer is None:
            number = len(state.splits.get(split, []))
            writer = RecordShardWriter(out / shard_name(split, number, "records"))
        writer.write(encode_record(items[index]))
        if writer.size >= shard_bytes:
            state.record(split, writer.close())
            writer = None
        progress.advance(task)
    if writer is not None:
        state.record(split, writer.close())


def _write_tokens(out: Path, split: str, data: bytes, state: PackState, shard_bytes: int,
                  progress: Progress) -> None:
    tokens = np.frombuffer(data, dtype=np.uint8)
    done = sum(shard.count for shard in state.splits.get(split, []))
    task = progress.add_task(f"{split}", total=len(tokens), completed=done, unit="bytes")
    for start in range(done, len(tokens), shard_bytes):
        number = len(state.splits.get(split, []))
        chunk = tokens[start:start + shard_bytes]
        state.record(split, write_token_shard(out / shard_name(split, number, "tokens"), chunk))
        progress.advance(task, len(chunk))


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


def pack(workload: str, src: str | Path | None, out: str | Path,
         shard_mb: float = DEFAULT_SHARD_MB, force: bool = False,
         progress: bool = True) -> Manifest:
    """Pack ``workload``'s data from ``src`` (its raw --data-dir; None: its default) into
    ``out``, continuing an interrupted pack of the same settings."""
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
    with progress_bar(progress) as bar:
        if kind == "tokens":
            for split, data in text_tokens(source).items():
                _write_tokens(out, split, data, state, shard_bytes, bar)
        else:
            records = workload_records(workload, source)
            for split, items in records.splits.items():
                _write_records(out, split, items, state, shard_bytes, bar)
            manifest.workload = records.workload
            manifest.layout = layout_of(records.splits["train"][0])
            manifest.example_layout = layout_of(records.example)
            manifest.meta = records.meta
            writer = RecordShardWriter(out / EXAMPLE_FILE)
            writer.write(encode_record(records.example))
            manifest.example = writer.close()
    manifest.splits = state.splits
    write_manifest(out, manifest)
    state.path.unlink()
    return manifest
