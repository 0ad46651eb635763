"""A shuffling sampler whose position can be saved and restored exactly."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Seeded per-epoch permutation that can start part-way through an epoch.

    The order depends only on ``(seed, epoch)``, never on global RNG state, so a resumed run
    draws exactly the samples an uninterrupted one would.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
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
        yield from order[self.start:].tolist()

    def __len__(self) -> int:
        return self.size - self.start
