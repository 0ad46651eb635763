"""One split of a packed set, read at random by global sample id, whatever its kind."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from gpuflow.data.kinds import kind_of
from gpuflow.data.manifest import Manifest, verify_shard
from gpuflow.data.record_codec import decode_record
from gpuflow.data.shard_files import RecordShard

OPEN_SHARDS = 8  # per split and process: bounds open files and memory-mapped pages


class SplitReader(Dataset):
    """One split of a packed set as a map-style dataset of samples, by global sample id.

    What a sample is comes from the set's kind (``gpuflow.data.kinds``): a record, or a
    window of ``seq_len + 1`` tokens. At most ``OPEN_SHARDS`` shards are open at once (least
    recently used closed first).
    """

    def __init__(self, directory: Path, manifest: Manifest, split: str,
                 seq_len: int | None = None) -> None:
        self.kind = kind_of(manifest, seq_len)
        self.directory, self.manifest, self.split = directory, manifest, split
        self.shards = manifest.splits[split]
        self.counts = [self.kind.samples(shard) for shard in self.shards]
        self.starts = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]).tolist()
        self._open: OrderedDict[int, Any] = OrderedDict()

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

    def _shard(self, number: int) -> Any:
        opened = self._open.get(number)
        if opened is None:
            info = self.shards[number]
            opened = self.kind.open(verify_shard(self.directory, self.manifest, info), info)
            self._open[number] = opened
            if len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
        else:
            self._open.move_to_end(number)
        return opened

    def _read(self, index: int) -> Any:
        """Sample ``index`` as stored."""
        number, position = self.locate(index)
        return self.kind.read(self._shard(number), position)

    def __getitem__(self, index: int) -> Any:
        return self.kind.item(self._read(index))

    def collated(self, indices: list[int]) -> Any:
        """``default_collate([self[i] for i in indices])``, decoded a batch at a time."""
        return self.kind.batch([self._read(index) for index in indices])


def read_example(directory: Path, manifest: Manifest) -> Any:
    """The example batch stored beside a set (None when there is none)."""
    if manifest.example is None:
        return None
    shard = RecordShard(verify_shard(directory, manifest, manifest.example))
    try:
        return decode_record(shard.read(0), manifest.example_layout)
    finally:
        shard.close()
