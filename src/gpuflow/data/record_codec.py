"""Items as bytes: a record is every tensor of a nested item, encoded depth first.

Each leaf is ``dtype code (u8) | ndim (u8) | shape (u64 each) | raw bytes``; Python ints and
floats are stored as 0-d int64 and float64 tensors. An item's nesting (its layout) is not in
the record: a packed set stores it once, in its manifest.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from gpuflow.errors import UserError

_TENSOR_HEAD = struct.Struct("<BB")
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}

RecordLayout = Any  # "t" (tensor), "i" (int), "f" (float), or a list of layouts


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
