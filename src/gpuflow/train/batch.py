"""The run's micro-batch and accumulation: as given, or probed under --batch-size auto; and
checked against --global-batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from gpuflow.config import TrainConfig
from gpuflow.errors import UserError
from gpuflow.parallel.dims import ParallelDims
from gpuflow.parallel.strategy import Loss
from gpuflow.precision import PrecisionPolicy
from gpuflow.train.probe import probe_step
from gpuflow.workload import Batch

if TYPE_CHECKING:
    from gpuflow.train.auto import BatchProbe


def fit_batch(config: TrainConfig, dims: ParallelDims, model: nn.Module, example: Batch,
              loss_fn: Loss, policy: PrecisionPolicy, device: torch.device
              ) -> tuple[TrainConfig, BatchProbe | None]:
    """``config`` with its micro-batch and accumulation settled, and what a probe found."""
    probe = None
    if config.batch_size == "auto":
        from gpuflow.train.auto import probe_batch_size  # the planner: only when probing

        def step(batch: Batch) -> None:
            probe_step(model, model, batch, loss_fn, policy, device)

        probe = probe_batch_size(model, example, step, config, dims.strategy, dims.dp, device,
                                 agree=_smallest_of_all(device) if dims.world > 1 else None)
        config = dataclasses.replace(config, batch_size=probe.micro_batch,
                                     grad_accum=probe.grad_accum)
    global_batch = dims.global_batch(config.batch_size, config.grad_accum)
    if config.global_batch is not None and config.global_batch != global_batch:
        raise UserError(
            f"--global-batch {config.global_batch} is not --batch-size {config.batch_size} "
            f"x --grad-accum {config.grad_accum} x {dims.dp} data-parallel ranks "
            f"({global_batch}); drop one, or use --batch-size auto.")
    return config, probe


def _smallest_of_all(device: torch.device) -> Callable[[int], int]:
    def agree(value: int) -> int:
        """The smallest of every rank's ``value``: all ranks act on the same verdict."""
        tensor = torch.tensor(value, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    return agree
