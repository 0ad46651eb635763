"""The kinds of packed set, as types: what a shard file holds and what one sample of it is.

A manifest names its set's kind once (``"records"`` or ``"tokens"``); ``kind_of`` turns that
name into one of the classes below, and everything past it (counting samples, opening a
shard, decoding a sample or a batch) asks the kind instead of comparing names. A new kind
of shard is a new class here, listed in ``KINDS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch

from gpuflow.data.manifest import Manifest, ShardInfo
from gpuflow.data.record_codec import RecordLayout, decode_batch, decode_record
from gpuflow.data.shard_files import TOKEN_DTYPE, RecordShard, TokenShard
from gpuflow.errors import UserError

OpenShard = TypeVar("OpenShard", RecordShard, TokenShard)
Stored = TypeVar("Stored")


class Kind(ABC, Generic[OpenShard, Stored]):
    """How one kind of set is stored and read: ``name`` is the manifest's ``kind``."""

    name: ClassVar[str]
    suffix: ClassVar[str]

    @classmethod
    def shard_name(cls, split: str, number: int) -> str:
        return f"{split}-{number:05d}{cls.suffix}"

    @classmethod
    @abstractmethod
    def from_manifest(cls, manifest: Manifest, seq_len: int | None) -> Kind[Any, Any]:
        """The kind of ``manifest``'s set, read in samples of ``seq_len`` where that applies."""

    @abstractmethod
    def samples(self, shard: ShardInfo) -> int:
        """How many samples the shard gives."""

    @abstractmethod
    def open(self, path: Path, shard: ShardInfo) -> OpenShard:
        """The verified shard at ``path``, opened for random reads."""

    @abstractmethod
    def read(self, opened: OpenShard, position: int) -> Stored:
        """Sample ``position`` of an open shard, as stored."""

    @abstractmethod
    def item(self, stored: Stored) -> Any:
        """A stored sample as the dataset yields it."""

    @abstractmethod
    def batch(self, stored: list[Stored]) -> Any:
        """``default_collate`` of the items, built from the stored samples at once."""


class TensorRecords(Kind[RecordShard, bytes]):
    """Record shards of encoded items (images, audio, a workload's own): sample i is
    record i, rebuilt with the set's layout."""

    name = "records"
    suffix = ".rec"

    def __init__(self, layout: RecordLayout) -> None:
        self.layout = layout

    @classmethod
    def from_manifest(cls, manifest: Manifest, seq_len: int | None) -> TensorRecords:
        return cls(manifest.layout)

    def samples(self, shard: ShardInfo) -> int:
        return shard.count

    def open(self, path: Path, shard: ShardInfo) -> RecordShard:
        return RecordShard(path)

    def read(self, opened: RecordShard, position: int) -> bytes:
        return opened.read(position)

    def item(self, stored: bytes) -> Any:
        return decode_record(stored, self.layout)

    def batch(self, stored: list[bytes]) -> Any:
        return decode_batch(stored, self.layout)


class TokenWindows(Kind[TokenShard, np.ndarray]):
    """Token shards cut into windows of ``seq_len + 1`` tokens, ``(x, y)`` with ``y``
    shifted by one. Windows never cross a shard, so each shard of n tokens gives
    ``(n - 1) // seq_len`` of them, and the sequence length is chosen when reading."""

    name = "tokens"
    suffix = ".npy"

    def __init__(self, seq_len: int, dtype: np.dtype = TOKEN_DTYPE) -> None:
        self.seq_len = seq_len
        self.dtype = dtype

    @classmethod
    def from_manifest(cls, manifest: Manifest, seq_len: int | None) -> TokenWindows:
        if seq_len is None:
            raise ValueError("token sets need a sequence length")
        return cls(seq_len, np.dtype(manifest.token_dtype).newbyteorder("<"))

    def samples(self, shard: ShardInfo) -> int:
        return max(0, (shard.count - 1) // self.seq_len)

    def open(self, path: Path, shard: ShardInfo) -> TokenShard:
        return TokenShard(path, shard, self.dtype)

    def read(self, opened: TokenShard, position: int) -> np.ndarray:
        return opened.read(position * self.seq_len, self.seq_len + 1)

    def item(self, stored: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(stored).long()
        return window[:-1], window[1:]

    def batch(self, stored: list[np.ndarray]) -> list[torch.Tensor]:
        windows = torch.from_numpy(np.stack(stored)).long()
        return [windows[:, :-1].contiguous(), windows[:, 1:].contiguous()]


KINDS: dict[str, type[Kind[Any, Any]]] = {kind.name: kind for kind in (TensorRecords,
                                                                      TokenWindows)}


def kind_of(manifest: Manifest, seq_len: int | None = None) -> Kind[Any, Any]:
    """The one place a manifest's ``kind`` becomes a type."""
    kind = KINDS.get(manifest.kind)
    if kind is None:
        raise UserError(f"This packed set's kind {manifest.kind!r} is unknown to this gpuflow "
                        f"(it reads {', '.join(KINDS)}). Upgrade gpuflow, or pack the data "
                        "again.")
    return kind.from_manifest(manifest, seq_len)
