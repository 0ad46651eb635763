"""DataLoaders for training: endless, resumable, seeded (evaluation: ``gpuflow.data.eval_set``)."""

from __future__ import annotations

import atexit
import multiprocessing
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, TensorDataset

from gpuflow.data.augment import Augment, AugmentedDataset, EpochKeyedBatches, EpochKeys
from gpuflow.data.iterable import StreamBatches, StreamPosition, is_stream
from gpuflow.data.sampler import BatchPlan, ResumableSampler
from gpuflow.data.streaming import StreamingDataset
from gpuflow.errors import UserError


def batches_per_epoch(dataset: Dataset, batch_size: int, world_size: int = 1) -> int:
    """Full batches each data-parallel rank draws per epoch."""
    count = len(dataset) // world_size // batch_size  # type: ignore[arg-type]
    if count == 0:
        raise UserError(
            f"--batch-size {batch_size} x {world_size} data-parallel rank(s) is larger than "
            f"the training set ({len(dataset)} samples); lower it."  # type: ignore[arg-type]
        )
    return count


def worker_init(num_workers: int) -> Callable[[int], None] | None:
    """The ``worker_init_fn`` of every loader of a run (training and evaluation)."""
    return outlive_stop_signals if num_workers > 0 else None


def outlive_stop_signals(worker_id: int) -> None:
    """A worker ignores SIGTERM and SIGUSR1, which a scheduler may send the whole process
    group: the trainer decides when to stop (``gpuflow.train.preemption``) and still needs
    batches until then. (:func:`_kill_workers_at_exit` ends them when the trainer exits.)"""
    for stop in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(stop, signal.SIG_IGN)


@atexit.register  # after multiprocessing's own handler, so it runs before it
def _kill_workers_at_exit() -> None:
    """At exit Python's multiprocessing stops daemon children with SIGTERM, then waits for
    them without a limit, and torch's own loader shutdown does nothing by then: a worker
    that ignores SIGTERM would keep a trainer that still holds a loader (an uncaught
    error's traceback, pytest's reports) from ever exiting. SIGKILL those first."""
    for child in multiprocessing.active_children():
        if child.daemon and _ignores_sigterm(child.pid):
            child.kill()
            child.join()


def _ignores_sigterm(pid: int | None) -> bool:
    """From /proc (Linux); False where it cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    ignored = next((line.split()[1] for line in status.splitlines()
                    if line.startswith("SigIgn:")), "0")
    return bool(int(ignored, 16) >> (signal.SIGTERM - 1) & 1)


def train_batches(dataset: Dataset, batch_size: int, collate: Any, seed: int,
                  start_batch: int, num_workers: int, pin_memory: bool, rank: int = 0,
                  world_size: int = 1, batched_indexing: bool = False,
                  augment: Augment | None = None,
                  stream_start: StreamPosition | None = None,
                  plan: BatchPlan | None = None) -> Iterable[Any]:
    """Endless stream of batches across epochs, starting after ``start_batch`` batches.

    The last partial batch of each epoch is dropped, so every step sees a full batch and
    the position is just a batch count: epoch = count // batches_per_epoch. A packed set
    (``StreamingDataset``) is streamed in its own shuffled order; any other dataset is
    indexed through a ``ResumableSampler``. Either way the batches depend only on the seed
    and the position, not on ``num_workers``.
    ``batched_indexing`` fetches a whole batch at once: one ``dataset[indices]`` call, which
    in-memory tensor datasets answer with a single gather instead of one item at a time
    and a stack, or one decoding pass over a packed batch; the batches are identical.
    ``augment`` transforms each item with a generator of (seed, epoch, index) (see
    ``gpuflow.data.augment``), so augmented batches resume exactly too.
    A workload's own stream (an ``IterableDataset``) is split, batched and resumed as
    ``gpuflow.data.iterable`` describes, from ``stream_start`` when one was saved.
    A workload's ``plan`` (its ``batch_sampler``) forms the batches of an indexed set.
    """
    workers: dict[str, Any] = {
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "prefetch_factor": 4 if num_workers > 0 else None,
        # The loader's own seed draw must not consume the global RNG that a resume restores.
        "generator": torch.Generator().manual_seed(seed),
        "worker_init_fn": worker_init(num_workers),
    }
    if is_stream(dataset):
        if augment is not None:
            raise UserError("Workload augment needs indexed samples (a seed per sample "
                            "index); augment a stream's samples in the stream itself.")
        return StreamBatches(dataset, batch_size, collate, rank, world_size, workers,
                             start_batch, stream_start)
    if plan is not None:
        return _planned_batches(dataset, plan, collate, seed, start_batch, workers, augment)
    per_epoch = batches_per_epoch(dataset, batch_size, world_size)
    if isinstance(dataset, StreamingDataset):
        stream = dataset.batches(seed, batch_size, per_epoch, start_batch, collate, rank,
                                 world_size, batched=batched_indexing, augment=augment)
        return iter(DataLoader(stream, batch_size=None, **workers))
    return _indexed_batches(dataset, batch_size, collate, seed, start_batch, per_epoch,
                            rank, world_size, batched_indexing, workers, augment)


def _indexed_batches(dataset: Dataset, batch_size: int, collate: Any, seed: int,
                     start_batch: int, per_epoch: int, rank: int, world_size: int,
                     batched_indexing: bool, workers: dict[str, Any],
                     augment: Augment | None) -> Iterator[Any]:
    sampler = (EpochKeys if augment else ResumableSampler)(
        len(dataset), seed, rank=rank, world_size=world_size)  # type: ignore[arg-type]
    if augment is not None:
        dataset = AugmentedDataset(dataset, augment, seed)
    batching: dict[str, Any] = (
        {"batch_size": None, "sampler": BatchSampler(sampler, batch_size, drop_last=True)}
        if batched_indexing else
        {"batch_size": batch_size, "sampler": sampler, "drop_last": True, "collate_fn": collate}
    )
    loader = DataLoader(
        dataset,
        **batching,
        **workers,
        persistent_workers=workers["num_workers"] > 0,
    )
    epoch, offset = divmod(start_batch, per_epoch)
    while True:
        sampler.set_position(epoch, offset * batch_size)
        yield from loader
        epoch, offset = epoch + 1, 0


def _planned_batches(dataset: Dataset, plan: BatchPlan, collate: Any, seed: int,
                     start_batch: int, workers: dict[str, Any],
                     augment: Augment | None) -> Iterator[Any]:
    sampler: Any = plan
    if augment is not None:
        dataset, sampler = AugmentedDataset(dataset, augment, seed), EpochKeyedBatches(plan)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **workers,
                        persistent_workers=workers["num_workers"] > 0)
    epoch, offset = divmod(start_batch, plan.per_rank)
    while True:
        plan.set_position(epoch, offset)
        yield from loader
        epoch, offset = epoch + 1, 0


def supports_batched_indexing(dataset: Dataset, collate_fn: Any,
                              augment: Augment | None = None) -> bool:
    """Whether a batch can be fetched whole and still equal the default collate's: one
    gather from in-memory tensors, or one decoding pass over a packed set's records,
    neither of them augmented item by item."""
    return (isinstance(dataset, TensorDataset | StreamingDataset) and collate_fn is None
            and augment is None)
