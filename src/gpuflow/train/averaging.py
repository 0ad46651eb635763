"""An exponential moving average of the weights, kept in the optimizer's state.

Late in a run the weights still wander from step to step, and a model judged on data unlike
its training set (a voice it never heard) can move by points with them. The average of the
last hundreds of steps lies in the middle of that wander and judges more steadily: the
averaged copy is what timm's ``ModelEma`` and Lightning's ``WeightAveraging`` evaluate. Here
each parameter's average is one more entry (``"ema"``) in ``optimizer.state[param]``, so every
layout's checkpoint saves, reshards and restores it with the optimizer's own state, and a
resumed run continues the same average bit for bit. Buffers (batch-norm statistics) are not
averaged: they follow the training weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.swa_utils import get_ema_multi_avg_fn

STATE_KEY = "ema"


class WeightAverage:
    """``decay`` per step: the average after a step is ``decay * average + (1 - decay) *
    weights``; the first step's weights start it."""

    def __init__(self, optimizer: torch.optim.Optimizer, decay: float) -> None:
        self.optimizer, self.decay = optimizer, decay
        self._lerp = get_ema_multi_avg_fn(decay)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def update(self) -> None:
        """Fold the weights of the step just taken into the average."""
        state = self.optimizer.state
        averaged = [p for p in self.params if STATE_KEY in state[p]]
        if averaged:
            self._lerp([self._average_of(p) for p in averaged], averaged, None)
        for p in self.params:
            if STATE_KEY not in state[p]:
                state[p][STATE_KEY] = p.detach().clone()

    def _average_of(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s average, placed like it: loaded from a one-process checkpoint into
        sharded parameters, the average is still the whole tensor (torch's full-state
        loading shards only the optimizer's own entries), so this rank keeps its shard."""
        average = self.optimizer.state[param][STATE_KEY]
        if isinstance(param, DTensor) and not isinstance(average, DTensor):
            average = distribute_tensor(average.to(param.to_local().device), param.device_mesh,
                                        param.placements, src_data_rank=None)
            self.optimizer.state[param][STATE_KEY] = average
        return average

    @property
    def started(self) -> bool:
        return bool(self.params) and STATE_KEY in self.optimizer.state[self.params[0]]

    @torch.no_grad()
    def load_into_weights(self) -> None:
        """Make the average the model's weights (the end of a run)."""
        if self.started:
            copy_each(self.params, [self._average_of(p) for p in self.params])

    @contextlib.contextmanager
    def weights_swapped_in(self) -> Iterator[None]:
        """The average in the model's weights for the duration (an evaluation), then the
        training weights back, in the same storage (CUDA graphs and compiled code keep
        their addresses)."""
        if not self.started:
            yield
            return
        with torch.no_grad():
            training = [p.detach().clone() for p in self.params]
            self.load_into_weights()
        try:
            yield
        finally:
            with torch.no_grad():
                copy_each(self.params, training)


def copy_each(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """In place, one by one: DTensor has no sharding rule for ``_foreach_copy_``."""
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)
