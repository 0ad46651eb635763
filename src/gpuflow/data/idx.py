"""Read the IDX format of MNIST and Fashion-MNIST (raw or gzip-compressed)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from gpuflow.errors import UserError

# Third magic byte: element type; fourth: number of dimensions.
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file into an array of its declared shape and type."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            data = handle.read()
    except (OSError, EOFError) as exc:
        raise UserError(f"Cannot read IDX file {path}: {exc}.") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise UserError(f"{path} is not an IDX file (bad magic number).")
    dims = data[3]
    header = 4 + 4 * dims
    if len(data) < header:
        raise UserError(f"{path} is truncated: its header is incomplete.")
    shape = struct.unpack(f">{dims}I", data[4:header])
    dtype = np.dtype(_DTYPES[data[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise UserError(
            f"{path} is truncated or padded: its header declares shape {shape} "
            f"({expected} bytes) but it holds {len(data) - header} bytes."
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write an unsigned-byte IDX file (gzip if the name ends in .gz); used to make test data."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as handle:
        handle.write(header + array.tobytes())


def find_split(directory: Path, prefix: str, kind: str) -> Path:
    """``prefix`` is train or t10k; ``kind`` is images or labels; raw or .gz."""
    ndim = 3 if kind == "images" else 1
    for name in (f"{prefix}-{kind}-idx{ndim}-ubyte", f"{prefix}-{kind}.idx{ndim}-ubyte"):
        for candidate in (directory / name, directory / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    raise UserError(
        f"No {prefix}-{kind}-idx{ndim}-ubyte[.gz] in {directory}. --data-dir must hold the four "
        "MNIST/Fashion-MNIST IDX files (train-images, train-labels, t10k-images, t10k-labels)."
    )


class IdxRecords:
    """The records of one IDX file (image i, or label i), read on access, never the whole
    file: one seek and one read each, which gzip answers by decompressing forward, so
    reading in order costs one pass over the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle = (gzip.open if path.suffix == ".gz" else open)(path, "rb")
        head = self._handle.read(4)
        if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _DTYPES:
            raise UserError(f"{path} is not an IDX file (bad magic number).")
        raw_shape = self._handle.read(4 * head[3])
        if len(raw_shape) < 4 * head[3]:
            raise UserError(f"{path} is truncated: its header is incomplete.")
        self.shape = struct.unpack(f">{head[3]}I", raw_shape)
        self.dtype = np.dtype(_DTYPES[head[2]])
        self._offset = 4 + 4 * head[3]
        self._size = int(np.prod(self.shape[1:])) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(index)
        self._handle.seek(self._offset + index * self._size)
        data = self._handle.read(self._size)
        if len(data) != self._size:
            raise UserError(f"{self.path} is truncated: record {index} is incomplete.")
        return np.frombuffer(data, dtype=self.dtype).reshape(self.shape[1:])

    def histogram(self, chunk: int = 1 << 20) -> np.ndarray:
        """How often each byte value occurs in the records (unsigned-byte files), read in
        chunks: exact statistics of any size of set in bounded memory."""
        if self.dtype != np.uint8:
            raise UserError(f"{self.path}: pixel statistics need unsigned-byte data.")
        counts = np.zeros(256, dtype=np.int64)
        self._handle.seek(self._offset)
        left = len(self) * self._size
        while left:
            data = self._handle.read(min(chunk, left))
            if not data:
                raise UserError(f"{self.path} is truncated: its records end early.")
            counts += np.bincount(np.frombuffer(data, np.uint8), minlength=256)
            left -= len(data)
        return counts


def pixel_stats(counts: np.ndarray) -> tuple[float, float]:
    """Mean and (unbiased) standard deviation of pixels scaled to [0, 1], from the counts
    of each byte value: exact, whatever the order or size of the set."""
    values = np.arange(256, dtype=np.float32) / np.float32(255.0)  # as float32 pixels hold them
    total = int(counts.sum())
    mean = float((counts * values.astype(np.float64)).sum() / total)
    var = float((counts * (values.astype(np.float64) - mean) ** 2).sum() / (total - 1))
    return mean, var ** 0.5
