"""A packed set's manifest: what it holds, in which format version, and every shard's checksum.

A packed set is a folder::

    manifest.json          format, workload, kind, token width, per-split shard list (file,
                           bytes, sha256, count)
    train-00000.rec ...    the shards, in the format of the set's kind (``gpuflow.data.kinds``)
    val-00000.*            the validation split, same layout
    example.rec            one record: the workload's example batch (record sets only)

The manifest is written last, so a folder with one is a finished set. Readers check each
shard's size when a set is opened and its SHA-256 the first time a process opens the shard,
so a corrupt shard is named before any of its data is used.

Format version 2 added ``token_dtype``, the width of a token set's tokens (uint8 bytes,
uint16 or uint32 ids of a tokenizer); a version 1 manifest has none and reads as uint8.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuflow.errors import UserError

if TYPE_CHECKING:
    from gpuflow.data.record_codec import RecordLayout

FORMAT = "gpuflow-shards"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
EXAMPLE_FILE = "example.rec"
PACK_STATE = ".pack-state.json"  # an unfinished pack's progress; gone once finished

@dataclass(frozen=True)
class ShardInfo:
    """One shard file: ``count`` is records (record shards) or tokens (token shards)."""

    file: str
    bytes: int
    sha256: str
    count: int


@dataclass
class Manifest:
    """What a packed set holds; ``kind`` names its shard format (``gpuflow.data.kinds``)."""

    workload: str
    kind: str
    splits: dict[str, list[ShardInfo]]
    layout: RecordLayout = None
    example: ShardInfo | None = None
    example_layout: RecordLayout = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    shard_bytes: int = 0
    token_dtype: str = "uint8"

    def count(self, split: str) -> int:
        return sum(shard.count for shard in self.splits[split])

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(self),
                "counts": {name: self.count(name) for name in self.splits}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        example = data.get("example")
        return cls(
            workload=data["workload"], kind=data["kind"],
            splits={name: [ShardInfo(**s) for s in shards]
                    for name, shards in data["splits"].items()},
            layout=data.get("layout"), example=ShardInfo(**example) if example else None,
            example_layout=data.get("example_layout"),
            meta=data.get("meta", {}), source=data.get("source"),
            shard_bytes=data.get("shard_bytes", 0),
            token_dtype=data.get("token_dtype", "uint8"),
        )


def is_packed(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


def load_manifest(directory: str | Path) -> Manifest:
    """Read and check ``manifest.json``: the format, its version and the shard sizes."""
    directory = Path(directory)
    try:
        data = json.loads((directory / MANIFEST).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format is {data.get('format')!r}, not {FORMAT!r}")
        manifest = Manifest.from_json(data)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{directory / MANIFEST} is not a readable packed-set manifest "
                        f"({exc}). Pack the data again with --force.") from None
    if data["format_version"] > FORMAT_VERSION:
        raise UserError(f"{directory} was packed in format version {data['format_version']}; "
                        f"this gpuflow reads up to {FORMAT_VERSION}. Upgrade gpuflow.")
    shards = [s for split in manifest.splits.values() for s in split]
    for shard in shards + ([manifest.example] if manifest.example else []):
        path = directory / shard.file
        size = path.stat().st_size if path.is_file() else None
        if size != shard.bytes:
            found = "is missing" if size is None else f"holds {size} bytes"
            raise corrupt_shard_error(directory, manifest,
                                      f"{path.name} {found}, the manifest says {shard.bytes}")
    return manifest


def commit_file(tmp: Path, path: Path) -> None:
    """Make a finished file durable, then give it its name in one rename."""
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
    commit_file(tmp, directory / MANIFEST)


def repack_hint(directory: Path, manifest: Manifest) -> str:
    source = f" {manifest.source}" if manifest.source else ""
    return (f"`gpuflow data pack{source} --out {directory} --workload {manifest.workload} "
            "--force`")


def corrupt_shard_error(directory: Path, manifest: Manifest, what: str) -> UserError:
    return UserError(
        f"Packed set {directory} is corrupt: {what}. The file was changed or damaged after "
        f"packing; pack the data again with {repack_hint(directory, manifest)}."
    )


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Streamed in 1 MiB chunks, so hashing a shard never holds it in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


_verified: set[tuple[str, str]] = set()


def verify_shard(directory: Path, manifest: Manifest, shard: ShardInfo) -> Path:
    """The shard's path, once its SHA-256 matched the manifest (hashed once per process)."""
    path = directory / shard.file
    key = (str(path), shard.sha256)
    if key not in _verified:
        found = sha256_file(path)
        if found != shard.sha256:
            raise corrupt_shard_error(
                directory, manifest,
                f"shard {shard.file} fails its checksum (sha256 {found[:12]}..., the manifest "
                f"says {shard.sha256[:12]}...)")
        _verified.add(key)
    return path
