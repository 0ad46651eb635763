"""Batches of utterances of similar length, each filled to a budget of audio seconds.

Padding a 1 s clip to the 7 s of its batch-mate wastes six seconds of compute; sorting
utterances into duration buckets and batching within a bucket wastes little, and a budget
of seconds (not of utterances) keeps each batch's memory alike whatever its clips' length
(NeMo, ESPnet and lhotse batch so). The budget counts padded seconds: a batch of ``n`` clips
whose longest lasts ``d`` seconds holds ``n * d <= budget``; a clip longer than the budget
forms a batch of its own.

The batches are formed once from the seed (as ESPnet's batch lists are); each epoch visits
them in an order drawn from (seed, epoch), so a resumed run, told its epoch and position,
draws exactly the batches an uninterrupted one would. Data-parallel rank ``r`` of ``n``
takes every n-th batch of that order from position ``r``, and the tail that does not
divide evenly is left out, so every rank takes as many steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from gpuflow.errors import UserError

DEFAULT_BUCKETS = 16


def fill_batches(durations: Sequence[float], members: Sequence[int],
                 batch_seconds: float) -> list[list[int]]:
    """``members`` (indices into ``durations``) in order, cut into batches whose padded
    seconds stay within ``batch_seconds``."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0.0
    for index in members:
        grown = max(longest, durations[index])
        if current and grown * (len(current) + 1) > batch_seconds:
            batches.append(current)
            current, grown = [], durations[index]
        current.append(index)
        longest = grown
    if current:
        batches.append(current)
    return batches


def bucket_count(durations: Sequence[float], batch_seconds: float,
                 most: int = DEFAULT_BUCKETS) -> int:
    """Buckets that each hold about four batches or more (at most ``most``), so the part-full
    batch each bucket ends with stays a small share of the epoch."""
    return max(1, min(most, round(sum(durations) / (4 * batch_seconds))))


def bucket_batches(durations: Sequence[float], batch_seconds: float, seed: int,
                   buckets: int | None = None) -> list[list[int]]:
    """Every utterance in one batch: ``buckets`` (default ``bucket_count``) equal-count
    duration buckets, each shuffled by ``seed`` and filled to ``batch_seconds``."""
    if batch_seconds <= 0:
        raise ValueError("batch_seconds must be positive")
    order = np.argsort(np.asarray(durations, dtype=np.float64), kind="stable")
    rng = np.random.default_rng([seed, 0x0B0C])
    batches: list[list[int]] = []
    count = buckets or bucket_count(durations, batch_seconds)
    for bucket in np.array_split(order, min(count, max(1, len(order)))):
        members = rng.permutation(bucket).tolist()
        batches.extend(fill_batches(durations, members, batch_seconds))
    return batches


def padding_fraction(durations: Sequence[float], batches: Sequence[Sequence[int]]) -> float:
    """Share of the padded seconds of ``batches`` that is padding."""
    padded = sum(len(batch) * max(durations[i] for i in batch) for batch in batches)
    spoken = sum(durations[i] for batch in batches for i in batch)
    return 1.0 - spoken / padded if padded else 0.0


class DurationBuckets(Sampler[list[int]]):
    """One rank's batches of indices (a ``DataLoader`` ``batch_sampler``), resumable by
    ``set_position(epoch, start_batch)``; ``len()`` is what is left of the epoch."""

    def __init__(self, durations: Sequence[float], batch_seconds: float, seed: int,
                 rank: int = 0, world_size: int = 1, buckets: int | None = None) -> None:
        self.batches = bucket_batches(durations, batch_seconds, seed, buckets)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.per_rank = len(self.batches) // world_size
        if self.per_rank == 0:
            raise UserError(f"--batch-seconds {batch_seconds:g} makes {len(self.batches)} "
                            f"batch(es) of the training set, too few to give each of "
                            f"{world_size} data-parallel ranks one: lower --batch-seconds.")
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        """Next iteration yields epoch ``epoch`` from this rank's batch ``start`` on."""
        self.epoch, self.start = epoch, start

    def epoch_order(self, epoch: int) -> list[int]:
        """This rank's batch numbers in ``epoch``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.batches), generator=generator)
        return order[self.rank:self.per_rank * self.world_size:self.world_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for number in self.epoch_order(self.epoch)[self.start:]:
            yield list(self.batches[number])

    def __len__(self) -> int:
        return self.per_rank - self.start
