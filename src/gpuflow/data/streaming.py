"""Streaming a packed set: sharded across ranks and loader workers, shuffled, resumable.

Each epoch's order is decided over global sample ids only, never over the data: the
shards are visited in a seeded random order, each shard's samples in turn pass through a
seeded shuffle buffer, and what leaves the buffer is the epoch's order. It depends only on
``(seed, epoch)``, so every rank computes the same order and takes every n-th sample of it
(as the map-style sampler does), and a resumed run fast-forwards by replaying ids, which
costs microseconds per sample and reads no data. Reads stay within the few shards the
buffer spans, and memory holds the buffer's ids and one batch, whatever the set's size.

Rank r's batches are numbered from the start position; loader worker w of W builds the
batches whose number is w modulo W, which is the order the DataLoader collects them in, so
the stream is the same with any number of workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from gpuflow.data.augment import Augment, sample_rng
from gpuflow.data.manifest import PACK_STATE, is_packed, load_manifest
from gpuflow.data.reader import SplitReader, read_example
from gpuflow.errors import UserError

DEFAULT_BUFFER = 4096
_DRAWS = 4096


def epoch_order(counts: list[int], seed: int, epoch: int,
                buffer_size: int = DEFAULT_BUFFER) -> Iterator[int]:
    """Every sample id of the epoch once: shards in a seeded order through a shuffle buffer.

    ``counts`` are the samples per shard; ids are numbered shard by shard.
    """
    rng = np.random.default_rng([seed, epoch])
    starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
    buffer: list[int] = []
    draws: list[int] = []
    for shard in rng.permutation(len(counts)).tolist():
        for sample in range(starts[shard], starts[shard + 1]):
            if len(buffer) < buffer_size:
                buffer.append(sample)
                continue
            if not draws:
                draws = rng.integers(0, buffer_size, _DRAWS).tolist()
            slot = draws.pop()
            yield buffer[slot]
            buffer[slot] = sample
    rng.shuffle(buffer)
    yield from buffer


class StreamingDataset(IterableDataset):
    """The training split of a packed set, streamed in the order ``epoch_order`` gives.

    It also answers ``len`` and ``dataset[i]`` (one read each), so the checks and example
    batches that map-style datasets get work unchanged. ``train_batches`` streams it through
    ``batches``; iterating it directly gives epoch 0 of seed 0, split across loader workers.
    """

    def __init__(self, reader: SplitReader, buffer_size: int = DEFAULT_BUFFER) -> None:
        self.reader = reader
        self.buffer_size = buffer_size

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int) -> Any:
        return self.reader[index]

    def order(self, seed: int, epoch: int) -> Iterator[int]:
        return epoch_order(self.reader.counts, seed, epoch, self.buffer_size)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for sample in islice(self.order(0, 0), worker, None, workers):
            yield self.reader[sample]

    def batches(self, seed: int, batch_size: int, per_epoch: int, start_batch: int,
                collate: Callable[[list[Any]], Any], rank: int = 0,
                world_size: int = 1, batched: bool = False,
                augment: Augment | None = None) -> BatchStream:
        """The endless batch stream of one data-parallel rank, from ``start_batch`` on.
        ``batched`` (for the default collate only) decodes each batch in one pass;
        ``augment`` transforms each sample with the generator of (seed, epoch, id)."""
        return BatchStream(self, seed, batch_size, per_epoch, start_batch, collate, rank,
                           world_size, batched, augment)


@dataclass
class BatchStream(IterableDataset):
    """Rank ``rank``'s batches, epoch after epoch, starting ``start_batch`` batches in.

    Each epoch rank r takes every ``world_size``-th id of the order from position r, cut to
    ``per_epoch`` full batches (the same count on every rank; the rest is dropped).
    """

    dataset: StreamingDataset
    seed: int
    batch_size: int
    per_epoch: int
    start_batch: int
    collate: Callable[[list[Any]], Any]
    rank: int = 0
    world_size: int = 1
    batched: bool = False
    augment: Augment | None = None

    def rank_batches(self, epoch: int) -> Iterator[list[int]]:
        """The sample ids of each of this rank's batches in ``epoch``."""
        taken = self.per_epoch * self.batch_size * self.world_size
        mine = islice(self.dataset.order(self.seed, epoch), self.rank, taken, self.world_size)
        for _ in range(self.per_epoch):
            yield list(islice(mine, self.batch_size))

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        epoch, skip = divmod(self.start_batch, self.per_epoch)
        produced = 0
        while True:
            for ids in islice(self.rank_batches(epoch), skip, None):
                if produced % workers == worker:
                    reader = self.dataset.reader
                    yield (reader.collated(ids) if self.batched
                           else self.collate([self.sample(epoch, i) for i in ids]))
                produced += 1
            epoch, skip = epoch + 1, 0

    def sample(self, epoch: int, sample: int) -> Any:
        """One sample as training sees it in ``epoch``: read, then augmented if asked."""
        item = self.dataset.reader[sample]
        return item if self.augment is None else self.augment(
            item, sample_rng(self.seed, epoch, sample))


@dataclass(frozen=True)
class PackedData:
    """A packed set opened for training: the streamed train split, the validation split
    (map-style),
    the stored example batch (record sets) and the workload's metadata."""

    train: StreamingDataset
    val: SplitReader | None
    example: Any
    meta: dict[str, Any]


def open_packed(data_dir: str | Path | None, workload: str,
                seq_len: int | None = None) -> PackedData | None:
    """The packed set in ``data_dir`` for ``workload``, or None when it holds none.

    A set packed for another workload, or a pack that never finished, is an error that
    says what to run. Token sets are cut into windows of ``seq_len``.
    """
    if data_dir is None:
        return None
    directory = Path(data_dir)
    if not is_packed(directory):
        if (directory / PACK_STATE).is_file():
            raise UserError(f"--data-dir {directory} holds a pack that did not finish; run "
                            "the same `gpuflow data pack` command again to complete it.")
        return None
    manifest = load_manifest(directory)
    if manifest.workload != workload:
        raise UserError(
            f"--data-dir {directory} was packed for workload {manifest.workload!r}, not "
            f"{workload!r}. Train it with --workload {manifest.workload}, or pack the data "
            f"for {workload} with `gpuflow data pack SRC --out DIR --workload {workload}`."
        )
    train = SplitReader(directory, manifest, "train", seq_len)
    if len(train) == 0:
        raise UserError(f"--data-dir {directory}: the packed training split holds no samples"
                        + (f" of {seq_len + 1} tokens" if seq_len else "") + ".")
    val = SplitReader(directory, manifest, "val", seq_len) if manifest.splits.get("val") else None
    return PackedData(StreamingDataset(train), val, read_example(directory, manifest),
                      manifest.meta)
