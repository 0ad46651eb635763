"""The packed data format: fixed-size shards, their index, and a manifest with checksums.

A packed set is a folder::

    manifest.json          format, workload, per-split shard list (file, bytes, sha256, count)
    train-00000.rec ...    record shards (images, audio): length-prefixed tensor records
    train-00000.npy ...    token shards (text): a 1-D array numpy can memory-map
    val-00000.*            the validation split, same layout
    example.rec            one record: the workload's example batch (record sets only)

A record shard is ``MAGIC | records | index | trailer``: each record is a little-endian
u32 length and an encoded item, the index holds the u64 offset of every record, and the
24-byte trailer holds the record count, the index offset and the magic again, so a reader
finds any record with one seek. Items are nested tuples of tensors and ints; their
structure (the layout) is stored once per set in the manifest, not in every record.

Readers check each shard's size when a set is opened and its SHA-256 the first time a
process opens the shard, so a corrupt shard is named before any of its data is used.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import mmap
import os
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from gpuflow.errors import UserError

FORMAT = "gpuflow-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
EXAMPLE_FILE = "example.rec"
PACK_STATE = ".pack-state.json"  # an unfinished pack's progress; gone once finished
MAGIC = b"GFSHARD1"
_TRAILER = struct.Struct("<QQ8s")
_LENGTH = struct.Struct("<I")
_TENSOR_HEAD = struct.Struct("<BB")
TOKEN_DTYPE = np.dtype(np.uint8)  # byte-level text: one token per byte
OPEN_SHARDS = 8  # per split and process: bounds open files and memory-mapped pages

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}

RecordLayout = Any  # "t" (tensor), "i" (int), "f" (float), or a list of layouts


# --- records ----------------------------------------------------------------------------

def layout_of(item: Any) -> RecordLayout:
    """The nesting of an item: tuples/lists of tensors and Python numbers."""
    if isinstance(item, torch.Tensor):
        return "t"
    if isinstance(item, bool | int | np.integer):
        return "i"
    if isinstance(item, float | np.floating):
        return "f"
    if isinstance(item, tuple | list):
        return [layout_of(part) for part in item]
    raise UserError(f"Cannot pack a {type(item).__name__}: dataset items must be tensors, "
                    "numbers, or tuples of them.")


def _leaves(item: Any) -> Iterator[torch.Tensor]:
    if isinstance(item, tuple | list):
        for part in item:
            yield from _leaves(part)
    else:
        yield torch.tensor(item, dtype=torch.float64) if isinstance(item, float) else \
            torch.as_tensor(item)


def encode_record(item: Any) -> bytes:
    """Every leaf as ``dtype code, ndim, shape, raw bytes``, in depth-first order."""
    parts: list[bytes] = []
    for tensor in _leaves(item):
        tensor = tensor.detach().cpu().contiguous()
        if tensor.dtype not in _DTYPE_CODES:
            raise UserError(f"Cannot pack tensors of dtype {tensor.dtype}.")
        parts.append(_TENSOR_HEAD.pack(_DTYPE_CODES[tensor.dtype], tensor.dim()))
        parts.append(struct.pack(f"<{tensor.dim()}Q", *tensor.shape))
        parts.append(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


@dataclass(frozen=True)
class _Leaf:
    """Where one leaf of a record sits: its header bytes, then its payload."""

    header_start: int
    payload_start: int
    payload_end: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str


def _leaf_spans(buffer: bytes, layout: RecordLayout) -> list[_Leaf]:
    """Every leaf of an encoded record, depth first, as ``layout`` lists them."""
    kinds: list[str] = []

    def flatten(spec: RecordLayout) -> None:
        if isinstance(spec, list):
            for part in spec:
                flatten(part)
        else:
            kinds.append(spec)

    flatten(layout)
    leaves, position = [], 0
    for kind in kinds:
        start = position
        code, ndim = _TENSOR_HEAD.unpack_from(buffer, position)
        position += _TENSOR_HEAD.size
        shape = struct.unpack_from(f"<{ndim}Q", buffer, position)
        position += 8 * ndim
        dtype = _DTYPES[code]
        size = math.prod(shape) * dtype.itemsize
        leaves.append(_Leaf(start, position, position + size, dtype, shape, kind))
        position += size
    return leaves


def _rebuild(layout: RecordLayout, leaves: Iterator[Any], sequence: type) -> Any:
    """``layout``'s nesting around values taken in order from ``leaves``."""
    if isinstance(layout, list):
        return sequence(_rebuild(part, leaves, sequence) for part in layout)
    return next(leaves)


def decode_record(buffer: bytes, layout: RecordLayout) -> Any:
    """The inverse of ``encode_record``, rebuilding tuples as ``layout`` describes."""

    def value(leaf: _Leaf) -> Any:
        raw = bytearray(buffer[leaf.payload_start:leaf.payload_end])
        tensor = (torch.frombuffer(raw, dtype=leaf.dtype) if raw else
                  torch.empty(0, dtype=leaf.dtype)).reshape(leaf.shape)
        return tensor if leaf.kind == "t" else tensor.item()

    return _rebuild(layout, (value(leaf) for leaf in _leaf_spans(buffer, layout)), tuple)


def decode_batch(records: list[bytes], layout: RecordLayout) -> Any:
    """``default_collate`` of the decoded records, built without per-record tensors.

    When every record has the first one's length and headers (the same shapes, as images
    and labels have), each leaf of the batch is one strided copy out of the joined records;
    otherwise the records are decoded one by one and collated. Either way the result is
    what ``default_collate([decode_record(r, layout) for r in records])`` returns.
    """
    first = records[0]
    leaves = _leaf_spans(first, layout)
    uniform = all(len(record) == len(first) for record in records) and all(
        record[leaf.header_start:leaf.payload_start] == first[leaf.header_start:leaf.payload_start]
        for record in records for leaf in leaves)
    if not uniform:
        return default_collate([decode_record(record, layout) for record in records])
    rows = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), len(first))

    def column(leaf: _Leaf) -> torch.Tensor:
        payload = np.array(rows[:, leaf.payload_start:leaf.payload_end])  # a writable copy
        tensor = torch.from_numpy(payload).view(leaf.dtype).reshape(len(records), *leaf.shape)
        if leaf.kind == "i" and leaf.dtype != torch.bool:
            return tensor.to(torch.int64)  # collated Python ints
        return tensor.to(torch.float64) if leaf.kind == "f" else tensor

    # default_collate turns a batch of tuples into a list of collated fields.
    return _rebuild(layout, (column(leaf) for leaf in leaves), list)


# --- manifest ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardInfo:
    """One shard file: ``count`` is records (record shards) or tokens (token shards)."""

    file: str
    bytes: int
    sha256: str
    count: int


@dataclass
class Manifest:
    """What a packed set holds; written last, so its presence means the set is complete."""

    workload: str
    kind: str  # "records" or "tokens"
    splits: dict[str, list[ShardInfo]]
    layout: RecordLayout = None
    example: ShardInfo | None = None
    example_layout: RecordLayout = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    shard_bytes: int = 0

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


# --- writing ----------------------------------------------------------------------------

def _commit(tmp: Path, path: Path) -> None:
    """Make a finished file durable, then give it its name in one rename."""
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class _ShardFile:
    """A shard written to a hidden temporary file; ``_finish`` makes it durable, names it
    and describes it for the manifest."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp")
        self._handle = open(self.tmp, "wb")  # noqa: SIM115 (open until close())

    def _finish(self, count: int) -> ShardInfo:
        self._handle.close()
        _commit(self.tmp, self.path)
        return ShardInfo(self.path.name, self.path.stat().st_size, sha256_file(self.path), count)


class RecordShardWriter(_ShardFile):
    """Appends encoded records; ``close`` writes the index and trailer and names the file."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._handle.write(MAGIC)
        self._offsets: list[int] = []
        self.size = len(MAGIC)

    def write(self, record: bytes) -> None:
        self._offsets.append(self.size)
        self._handle.write(_LENGTH.pack(len(record)))
        self._handle.write(record)
        self.size += _LENGTH.size + len(record)

    @property
    def count(self) -> int:
        return len(self._offsets)

    def close(self) -> ShardInfo:
        index_offset = self.size
        self._handle.write(np.asarray(self._offsets, dtype="<u8").tobytes())
        self._handle.write(_TRAILER.pack(self.count, index_offset, MAGIC))
        return self._finish(self.count)


class TokenShardWriter(_ShardFile):
    """A token shard of ``count`` tokens in numpy's .npy format, written as the tokens
    arrive: the header (which only needs the count) first, so no shard is held in memory."""

    def __init__(self, path: Path, count: int) -> None:
        super().__init__(path)
        np.lib.format.write_array_header_1_0(self._handle, {
            "descr": np.lib.format.dtype_to_descr(TOKEN_DTYPE), "fortran_order": False,
            "shape": (count,)})
        self.count = count
        self.written = 0

    def write(self, tokens: bytes) -> None:
        if self.written + len(tokens) > self.count:
            raise ValueError(f"{self.path.name}: more than the {self.count} tokens announced")
        self._handle.write(tokens)
        self.written += len(tokens)

    def close(self) -> ShardInfo:
        if self.written != self.count:
            raise ValueError(f"{self.path.name}: {self.written} of {self.count} tokens written")
        return self._finish(self.count)


def write_token_shard(path: Path, tokens: np.ndarray) -> ShardInfo:
    """A 1-D token array in numpy's .npy format, which ``np.load(mmap_mode='r')`` maps."""
    writer = TokenShardWriter(path, len(tokens))
    writer.write(np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE).tobytes())
    return writer.close()


def write_manifest(directory: Path, manifest: Manifest) -> None:
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
    _commit(tmp, directory / MANIFEST)


# --- reading ----------------------------------------------------------------------------

class RecordShard:
    """Random access to the records of one verified shard, by ``os.pread``: reads copy
    only the record asked for, so memory does not grow with the shard."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        count, index_offset, magic = _TRAILER.unpack(
            os.pread(self._fd, _TRAILER.size, size - _TRAILER.size))
        if magic != MAGIC:
            raise UserError(f"{path} is not a gpuflow record shard (bad trailer).")
        self.offsets = np.frombuffer(os.pread(self._fd, 8 * count, index_offset), dtype="<u8")
        # Record i ends where record i + 1 (or the index) begins: one read per record.
        self.ends = np.append(self.offsets[1:], np.uint64(index_offset))

    def read(self, index: int) -> bytes:
        offset, end = int(self.offsets[index]), int(self.ends[index])
        return os.pread(self._fd, end - offset, offset)[_LENGTH.size:]

    def close(self) -> None:
        os.close(self._fd)


class TokenShard:
    """A memory-mapped token array. The data sits at the end of the .npy file, so the
    manifest's sizes locate it without parsing the header; windows are copied out, and
    closing the shard unmaps its pages."""

    def __init__(self, path: Path, shard: ShardInfo) -> None:
        with open(path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        offset = shard.bytes - shard.count * TOKEN_DTYPE.itemsize
        self.tokens = np.frombuffer(self._map, TOKEN_DTYPE, shard.count, offset)

    def read(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start:start + length].copy()

    def close(self) -> None:
        del self.tokens
        self._map.close()


class SplitReader(Dataset):
    """One split of a packed set as a map-style dataset of samples, by global sample id.

    Record sets: sample i is record i. Token sets: sample i is a window of ``seq_len + 1``
    tokens, ``(x, y)`` with ``y`` shifted by one; windows never cross a shard, so each
    shard of n tokens gives ``(n - 1) // seq_len`` of them. At most ``OPEN_SHARDS`` shards
    are open at once (least recently used closed first).
    """

    def __init__(self, directory: Path, manifest: Manifest, split: str,
                 seq_len: int | None = None) -> None:
        if manifest.kind == "tokens" and seq_len is None:
            raise ValueError("token sets need a sequence length")
        self.directory, self.manifest, self.split = directory, manifest, split
        self.shards = manifest.splits[split]
        self.seq_len = seq_len
        self.counts = [self._samples(shard) for shard in self.shards]
        self.starts = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]).tolist()
        self._open: OrderedDict[int, RecordShard | TokenShard] = OrderedDict()

    def _samples(self, shard: ShardInfo) -> int:
        if self.manifest.kind == "records":
            return shard.count
        assert self.seq_len is not None
        return max(0, (shard.count - 1) // self.seq_len)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": OrderedDict()}  # handles stay in their process

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard, position in shard)`` of global sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def _shard(self, number: int) -> RecordShard | TokenShard:
        opened = self._open.get(number)
        if opened is None:
            path = verify_shard(self.directory, self.manifest, self.shards[number])
            opened = (RecordShard(path) if self.manifest.kind == "records"
                      else TokenShard(path, self.shards[number]))
            self._open[number] = opened
            if len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
        else:
            self._open.move_to_end(number)
        return opened

    def _read(self, index: int) -> bytes | np.ndarray:
        """Sample ``index`` as stored: a record's bytes, or a window of tokens."""
        number, position = self.locate(index)
        shard = self._shard(number)
        if isinstance(shard, RecordShard):
            return shard.read(position)
        assert self.seq_len is not None
        return shard.read(position * self.seq_len, self.seq_len + 1)

    def __getitem__(self, index: int) -> Any:
        stored = self._read(index)
        if isinstance(stored, bytes):
            return decode_record(stored, self.manifest.layout)
        window = torch.from_numpy(stored).long()
        return window[:-1], window[1:]

    def collated(self, indices: list[int]) -> Any:
        """``default_collate([self[i] for i in indices])``, decoded a batch at a time."""
        stored = [self._read(index) for index in indices]
        if self.manifest.kind == "records":
            return decode_batch(stored, self.manifest.layout)  # type: ignore[arg-type]
        windows = torch.from_numpy(np.stack(stored)).long()
        return [windows[:, :-1].contiguous(), windows[:, 1:].contiguous()]


def read_example(directory: Path, manifest: Manifest) -> Any:
    """The example batch stored beside a record set (None when there is none)."""
    if manifest.example is None:
        return None
    shard = RecordShard(verify_shard(directory, manifest, manifest.example))
    try:
        return decode_record(shard.read(0), manifest.example_layout)
    finally:
        shard.close()


def shard_name(split: str, number: int, kind: str) -> str:
    return f"{split}-{number:05d}.{'rec' if kind == 'records' else 'npy'}"
