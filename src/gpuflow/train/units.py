"""What a step counts over all data-parallel replicas: its samples, when batches vary in size,
and the units its loss is a mean over (``Workload.loss_units``), in one all-reduce.

A loss averaged over each rank's own units (CTC's target characters), then over the ranks by
DDP's gradient average, weighs a unit in a small batch more than one in a large batch: two
ranks then do not train as one process on their union. As torchtitan and Megatron-LM do, a
step that weighs its loss first counts the units of all its micro-batches on every replica,
then weighs each micro-batch's mean loss by ``units * dp * accum / global_units``: the
strategy's division by ``accum`` and the gradient average over ``dp`` replicas make that the
gradient of the union's per-unit mean, and the logged loss (the mean over ranks and
micro-batches) that mean itself. A pipeline splits each micro-batch into ``splits`` pieces
again, calls the loss on its last stage once a piece and divides by ``splits``: each piece's
weight is its own units times ``splits`` over the same total, so the weighted loss counts a
piece's units from the targets it is called with. Nothing is synchronised inside the loss
function, which probes and evaluation call where no peer exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpuflow.parallel.dims import ParallelDims
from gpuflow.parallel.strategy import Loss
from gpuflow.workload import Workload


@dataclass(frozen=True)
class StepCounts:
    """One step's ``[samples, units]`` over all replicas (on the device until read), and
    what a loss over a batch (or a pipeline's piece of one) is weighed by per unit."""

    totals: torch.Tensor
    per_unit: torch.Tensor | None


class StepCounter:
    """Counts a workload's steps; weighs its loss when it declares loss units."""

    def __init__(self, workload: Workload, dims: ParallelDims, device: torch.device,
                 global_batch: int, accum: int) -> None:
        self.loss_units = workload.loss_units
        # What a pipeline splits each micro-batch into before its loss; 1 without one.
        self.splits = dims.pipeline_microbatches(global_batch // (accum * dims.dp))
        self.counts_samples = workload.batch_sampler is not None
        self.dims, self.device = dims, device
        self.global_batch, self.accum = global_batch, accum

    @property
    def weighs_loss(self) -> bool:
        """Whether a step must count its units before its first backward."""
        return self.loss_units is not None

    def count(self, targets: list[torch.Tensor]) -> StepCounts:
        """The step's counts from the targets of all its micro-batches (a collective when
        distributed: every rank calls it once a step)."""
        samples = torch.tensor(sum(int(t.shape[0]) for t in targets), device=self.device)
        units = ([torch.as_tensor(self.loss_units(t), dtype=torch.int64,
                                  device=self.device).reshape(())
                  for t in targets] if self.loss_units is not None else [])
        totals = torch.stack([samples, sum(units, torch.zeros_like(samples))])
        if self.dims.world > 1:
            dist.all_reduce(totals)
            # Ranks within a replica (tensor or pipeline parallel) share its batch.
            totals = totals // (self.dims.world // self.dims.dp)
        if self.loss_units is None:
            return StepCounts(totals, None)
        scale = self.dims.dp * self.accum * self.splits / totals[1].clamp(min=1).float()
        return StepCounts(totals, scale)

    def samples(self, targets: list[torch.Tensor], counts: StepCounts | None) -> int:
        """Samples in the step over all replicas: the global batch, unless the workload
        forms batches of varying size."""
        if not self.counts_samples:
            return self.global_batch
        return int((counts or self.count(targets)).totals[0].item())

    def weighted(self, loss_fn: Loss, counts: StepCounts | None) -> Loss:
        """``loss_fn``, weighed by the units of the targets it is called with (a whole
        micro-batch's, or a pipeline piece's) when the step counted its units."""
        if counts is None or counts.per_unit is None or self.loss_units is None:
            return loss_fn
        units_of, per_unit = self.loss_units, counts.per_unit

        def weighted_loss(outputs: Any, target: torch.Tensor) -> torch.Tensor:
            units = torch.as_tensor(units_of(target), device=per_unit.device).reshape(())
            return loss_fn(outputs, target) * (units.float() * per_unit)

        return weighted_loss
