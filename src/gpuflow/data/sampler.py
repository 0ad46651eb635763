"""A shuffling sampler whose position can be saved and restored exactly, and the shape of a
workload's own batches (``BatchPlan``), which the loader and the augmentation both take."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch.utils.data import Sampler


class BatchPlan(Protocol):
    """A workload's own training batches for one rank (``Workload.batch_sampler``)."""

    per_rank: int  # batches this rank takes each epoch, the same on every rank
    epoch: int  # the epoch its next iteration yields

    def set_position(self, epoch: int, start: int) -> None: ...

    def __iter__(self) -> Iterator[list[int]]: ...

    def __len__(self) -> int: ...


class ResumableSampler(Sampler[int]):
    """Seeded per-epoch permutation, sharded across data-parallel ranks, that can start
    part-way through an epoch.

    The order depends only on ``(seed, epoch)``, never on global RNG state, so a resumed run
    draws exactly the samples an uninterrupted one would. Rank ``r`` of ``n`` takes every
    n-th sample from position r, so consecutive global batches are split across ranks exactly
    as one process with an n-times larger batch would see them; the tail that does not
    divide evenly is dropped so every rank sees as many samples and no sample is seen twice.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1) -> None:
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.per_rank = size // world_size
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        """Next iteration yields epoch ``epoch`` from sample ``start`` on."""
        self.epoch = epoch
        self.start = start

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.size, generator=generator)
        else:
            order = torch.arange(self.size)
        mine = order[self.rank:self.per_rank * self.world_size:self.world_size]
        yield from mine[self.start:].tolist()

    def __len__(self) -> int:
        return self.per_rank - self.start
