"""What an evaluation reads: the whole validation set, or a fixed subset of its batches.

A large validation set evaluated whole can cost more than the training between two
evaluations (150 M tokens of held-out text take longer than a short run). ``--eval-batches
N`` reads N batches instead: for a map-style set, N blocks of consecutive samples spread
evenly over it (consecutive, so packed shards are read in runs; spread, so one document or
shard does not stand for the set); for a stream, its first N batches. The samples are the
same at every evaluation, so the curve compares like with like; a set of at most N batches
is evaluated whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

from torch.utils.data import DataLoader, Dataset, Subset

from gpuflow.data.iterable import RankSamples, is_sized, is_stream
from gpuflow.data.loader import worker_init
from gpuflow.errors import UserError


@dataclass(frozen=True)
class EvalSet:
    """The samples each evaluation reads, in ``batches`` batches (None: a stream read to
    its end) out of a set of ``total`` samples (None: an unsized stream)."""

    dataset: Dataset
    batch_size: int
    batches: int | None
    total: int | None
    whole: bool

    def describe(self) -> str:
        if self.whole:
            return (f"the whole validation set ({self.total:,} samples)" if self.total
                    is not None else "the whole validation stream")
        if not is_stream(self.dataset):
            assert self.total is not None and self.batches is not None
            return (f"{self.batches} of {-(-self.total // self.batch_size):,} validation "
                    f"batches ({self.batches * self.batch_size:,} of {self.total:,} samples, "
                    "the same each time)")
        return f"the first {self.batches} batches of the validation stream"

    def loader(self, collate: Callable[[list[Any]], Any], num_workers: int,
               pin_memory: bool) -> Iterable[Any]:
        """One pass over the evaluated samples, in order; its workers outlive a preemption's
        signal like the training loader's (``gpuflow.data.loader.worker_init``)."""
        workers = {"num_workers": num_workers, "pin_memory": pin_memory,
                   "worker_init_fn": worker_init(num_workers)}
        if is_stream(self.dataset):
            loader = DataLoader(RankSamples(self.dataset), batch_size=self.batch_size,
                                collate_fn=collate, **workers)
            return loader if self.batches is None else islice(loader, self.batches)
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False,
                          collate_fn=collate, **workers)


def eval_set(dataset: Dataset, batch_size: int, eval_batches: int) -> EvalSet:
    """The evaluated part of ``dataset``: ``eval_batches`` batches of it (0: all of it)."""
    total = len(dataset) if is_sized(dataset) else None  # type: ignore[arg-type]
    whole = eval_batches == 0 or (total is not None and total <= eval_batches * batch_size)
    if is_stream(dataset):
        if whole and total is None:
            raise UserError(
                "The validation dataset is a stream without a length, which cannot be "
                "evaluated whole: give --eval-batches N (N batches from its start).")
        return EvalSet(dataset, batch_size, None if whole else eval_batches, total, whole)
    assert total is not None
    if whole:
        return EvalSet(dataset, batch_size, -(-total // batch_size), total, True)
    spacing = total // eval_batches
    indices = [block * spacing + offset for block in range(eval_batches)
               for offset in range(batch_size)]
    return EvalSet(Subset(dataset, indices), batch_size, eval_batches, total, False)
