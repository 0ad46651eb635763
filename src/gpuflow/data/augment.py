"""Training-time augmentation whose randomness is a function of (seed, epoch, sample index).

A workload's ``augment(item, rng)`` transforms one training item with the numpy generator it
is given. The generator is seeded from the run's seed, the epoch and the sample's index only,
never from global state, so an epoch sees the same augmented items whatever the number of
loader workers or ranks, and a resumed run sees exactly the batches an uninterrupted one
would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from gpuflow.data.sampler import BatchPlan, ResumableSampler

Augment = Callable[[Any, np.random.Generator], Any]


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator that augments sample ``index`` in ``epoch`` of a run seeded ``seed``."""
    return np.random.default_rng([seed, epoch, index])


class AugmentedDataset(Dataset):
    """``dataset`` whose items are fetched by ``(epoch, index)`` keys and augmented."""

    def __init__(self, dataset: Dataset, augment: Augment, seed: int) -> None:
        self.dataset, self.augment, self.seed = dataset, augment, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        return self.augment(self.dataset[index], sample_rng(self.seed, epoch, index))


class EpochKeys(ResumableSampler):
    """A ``ResumableSampler`` that yields ``(epoch, index)`` keys for ``AugmentedDataset``."""

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        epoch = self.epoch
        for index in super().__iter__():
            yield epoch, index


class EpochKeyedBatches:
    """A ``BatchPlan``'s batches as lists of ``(epoch, index)`` keys for ``AugmentedDataset``."""

    def __init__(self, plan: BatchPlan) -> None:
        self.plan = plan

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.plan.epoch
        for batch in self.plan:
            yield [(epoch, index) for index in batch]

    def __len__(self) -> int:
        return len(self.plan)
