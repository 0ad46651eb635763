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
