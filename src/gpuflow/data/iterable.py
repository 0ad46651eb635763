"""A workload's own stream (a ``torch.utils.data.IterableDataset``): split, batched, resumed.

Streams are how large data arrives (a queue, an object store, Hugging Face ``datasets`` in
streaming mode, WebDataset shards), sized or endless. Each data-parallel rank must read
different samples, and so must each loader worker within a rank:

- a Hugging Face ``datasets.IterableDataset`` splits itself: ``split_dataset_by_node``
  gives each rank its own shards (or every n-th example), and it divides its shards among
  loader workers by itself;
- any other stream is read whole by every rank and worker, each keeping every
  ``ranks x workers``-th sample from its own offset: no sample is seen twice, at the cost
  of each reader passing over the others' samples.

A stream that runs out starts again (the next epoch; ``set_epoch`` is called where the
dataset has it), so training runs to ``--max-steps`` whatever the stream's length.

Resume is exact where the dataset can save its position (``state_dict`` and
``load_state_dict``, as Hugging Face's streaming datasets offer) and is read in the training
process (``--num-workers 0``): the position after each batch is recorded as the batch is
made, and the checkpoint holds the one after the last batch trained on. Otherwise a resumed
run continues from a fresh iterator, and says so.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from gpuflow.data.streaming import StreamingDataset
from gpuflow.errors import UserError

_RECORDED = 64  # positions kept: more than the batches any prefetcher holds ahead


def is_stream(dataset: Any) -> bool:
    """An iterable dataset that is not one of gpuflow's packed sets (those index their
    samples and resume by position; see ``gpuflow.data.streaming``)."""
    return isinstance(dataset, IterableDataset) and not isinstance(dataset, StreamingDataset)


def is_sized(dataset: Any) -> bool:
    try:
        len(dataset)
    except TypeError:
        return False
    return True


def is_stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None))


def splits_itself(dataset: Any) -> bool:
    """A Hugging Face ``datasets.IterableDataset``, which shards itself by rank and worker."""
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "n_shards")


def for_rank(dataset: Any, rank: int, world_size: int) -> Any:
    """The dataset a data-parallel rank reads: its own split where the dataset makes one."""
    if world_size == 1 or not splits_itself(dataset):
        return dataset
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(dataset, rank=rank, world_size=world_size)


def peek(dataset: Any, count: int) -> list[Any]:
    """The stream's first ``count`` samples, leaving a stateful stream where it was."""
    state = copy.deepcopy(dataset.state_dict()) if is_stateful(dataset) else None
    samples = list(islice(iter(dataset), count))
    if state is not None:
        dataset.load_state_dict(state)
    return samples


class RankSamples(IterableDataset):
    """The samples of one rank and loader worker: all of a self-splitting dataset's (it has
    been split for the rank already), else every ``world_size x workers``-th from this
    reader's offset. ``resumed``: the dataset was restored to just after this reader's last
    sample (one worker only), so the next is a full stride on."""

    def __init__(self, dataset: Any, rank: int = 0, world_size: int = 1,
                 resumed: bool = False) -> None:
        self.dataset, self.rank, self.world_size, self.resumed = (dataset, rank, world_size,
                                                                  resumed)

    def __iter__(self) -> Iterator[Any]:
        if splits_itself(self.dataset):
            yield from self.dataset
            return
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        stride = self.world_size * workers
        offset = stride - 1 if self.resumed else self.rank + self.world_size * worker
        yield from islice(iter(self.dataset), offset, None, stride)


@dataclass(frozen=True)
class StreamPosition:
    """Where a rank's stream stands: the epoch (pass over the stream) and the dataset's
    own saved state within it."""

    epoch: int
    state: Any

    def as_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "state": self.state}


class StreamBatches:
    """One rank's endless batches of a stream, from ``start`` (a saved position) on.

    Batches are full (``drop_last``); a pass that yields none is an error, since training
    could never take a step.
    """

    def __init__(self, dataset: Any, batch_size: int, collate: Callable[[list[Any]], Any],
                 rank: int, world_size: int, loader_options: dict[str, Any],
                 start_batch: int = 0, start: StreamPosition | None = None) -> None:
        self.dataset = for_rank(dataset, rank, world_size)
        self.batch_size, self.collate = batch_size, collate
        self.rank, self.world_size = rank, world_size
        self.options = loader_options
        self.exact = is_stateful(self.dataset) and loader_options.get("num_workers", 0) == 0
        self.start = start if self.exact else None
        self._start_batch = self._number = start_batch
        self._positions: deque[tuple[int, StreamPosition]] = deque(maxlen=_RECORDED)
        self._lock = threading.Lock()

    def _loader(self, resumed: bool) -> DataLoader:
        return DataLoader(RankSamples(self.dataset, self.rank, self.world_size, resumed),
                          batch_size=self.batch_size, collate_fn=self.collate, drop_last=True,
                          **self.options)

    def __iter__(self) -> Iterator[Any]:
        epoch, state = (self.start.epoch, self.start.state) if self.start else (0, None)
        while True:
            if callable(getattr(self.dataset, "set_epoch", None)):
                self.dataset.set_epoch(epoch)
            if state is not None:
                self.dataset.load_state_dict(state)
            produced = 0
            for batch in self._loader(resumed=state is not None):
                produced += 1
                self._record(epoch)
                yield batch
            if produced == 0:
                raise UserError(
                    f"The train stream gave data-parallel rank {self.rank} fewer than "
                    f"--batch-size {self.batch_size} samples in a whole pass; lower "
                    "--batch-size or give the stream more data.")
            epoch, state = epoch + 1, None

    def _record(self, epoch: int) -> None:
        with self._lock:
            self._number += 1
            if self.exact:
                position = StreamPosition(epoch, copy.deepcopy(self.dataset.state_dict()))
                self._positions.append((self._number, position))

    def position_after(self, batches: int) -> StreamPosition | None:
        """The position just after the run's first ``batches`` batches, if recorded."""
        if batches == self._start_batch:
            return self.start
        with self._lock:
            for number, position in reversed(self._positions):
                if number == batches:
                    return position
        return None


def resume_note(dataset: Dataset, exact: bool) -> str:
    """What a resumed run says about its stream."""
    if exact:
        return "the train stream resumes at its saved position"
    why = ("it has no state_dict/load_state_dict" if not is_stateful(dataset) else
           "its position is only saved when it is read in the training process "
           "(--num-workers 0)")
    return (f"the train stream cannot be resumed exactly ({why}): it continues from a "
            "fresh iterator, so the batches from here on differ from an uninterrupted run's")
