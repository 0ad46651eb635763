"""One shard file of each format, written once and read at random.

A record shard is ``MAGIC | records | index | trailer``: each record is a little-endian u32
length and an encoded item (``gpuflow.data.record_codec``), the index holds the u64 offset of
every record, and the 24-byte trailer holds the record count, the index offset and the magic
again, so a reader finds any record with one seek.

A token shard is a 1-D array in numpy's .npy format, which ``np.load(mmap_mode='r')`` maps.

Writers write to a hidden temporary file and give it its name once it is durable, so a shard
with its final name is whole.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np

from gpuflow.data.manifest import ShardInfo, commit_file, sha256_file
from gpuflow.errors import UserError

MAGIC = b"GFSHARD1"
_TRAILER = struct.Struct("<QQ8s")
_LENGTH = struct.Struct("<I")
TOKEN_DTYPE = np.dtype(np.uint8)  # byte-level text: one token per byte


class _ShardFile:
    """A shard written to a hidden temporary file; ``_finish`` makes it durable, names it
    and describes it for the manifest."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp")
        self._handle = open(self.tmp, "wb")  # noqa: SIM115 (open until close())

    def _finish(self, count: int) -> ShardInfo:
        self._handle.close()
        commit_file(self.tmp, self.path)
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
    """A token shard of ``count`` tokens, written as the tokens arrive: the .npy header
    (which only needs the count) first, so no shard is held in memory."""

    def __init__(self, path: Path, count: int, dtype: np.dtype = TOKEN_DTYPE) -> None:
        super().__init__(path)
        np.lib.format.write_array_header_1_0(self._handle, {
            "descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
            "shape": (count,)})
        self.dtype = dtype
        self.count = count
        self.written = 0

    def write(self, tokens: bytes) -> None:
        """Tokens as raw bytes in the shard's dtype (little-endian)."""
        added = len(tokens) // self.dtype.itemsize
        if self.written + added > self.count:
            raise ValueError(f"{self.path.name}: more than the {self.count} tokens announced")
        self._handle.write(tokens)
        self.written += added

    def close(self) -> ShardInfo:
        if self.written != self.count:
            raise ValueError(f"{self.path.name}: {self.written} of {self.count} tokens written")
        return self._finish(self.count)


def write_token_shard(path: Path, tokens: np.ndarray, dtype: np.dtype = TOKEN_DTYPE
                      ) -> ShardInfo:
    """A whole 1-D token array as one shard."""
    writer = TokenShardWriter(path, len(tokens), dtype)
    writer.write(np.ascontiguousarray(tokens, dtype=dtype).tobytes())
    return writer.close()


class RecordShard:
    """Random access to the records of one shard, by ``os.pread``: reads copy only the
    record asked for, so memory does not grow with the shard."""

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

    def __init__(self, path: Path, shard: ShardInfo, dtype: np.dtype = TOKEN_DTYPE) -> None:
        with open(path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        offset = shard.bytes - shard.count * dtype.itemsize
        self.tokens = np.frombuffer(self._map, dtype, shard.count, offset)

    def read(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start:start + length].copy()

    def close(self) -> None:
        del self.tokens
        self._map.close()
