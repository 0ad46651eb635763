"""`--strategy auto` and `--batch-size auto`: the planner's choices, applied to a run.

The strategy comes from the planner's predictions for the devices present (no trial runs);
the micro-batch from real allocations on the device, probing growing batches of the
workload's own data. Both keep the global batch the user asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpuflow.config import TrainConfig
from gpuflow.config_fields import DEFAULT_BATCH_SIZE
from gpuflow.devices import total_memory
from gpuflow.errors import UserError
from gpuflow.parallel.strategy import resize_rows
from gpuflow.planner import choose_plan, find_max_batch_size
from gpuflow.planner.batch_size import accumulation_for
from gpuflow.planner.layout import OPTIMIZER_STATE_BYTES
from gpuflow.planner.search import Plan
from gpuflow.workload import Batch, Workload

# Strategies whose memory one process can probe for all: the model is whole on each rank.
_PROBED_STRATEGIES = ("single", "ddp")


def requested_global_batch(config: TrainConfig, world: int) -> int:
    """--global-batch, or what the micro-batch, accumulation and world size give."""
    if config.global_batch is not None:
        return config.global_batch
    micro = DEFAULT_BATCH_SIZE if config.batch_size == "auto" else config.batch_size
    return micro * config.grad_accum * world


def plan_strategy(workload: Workload, config: TrainConfig, world: int
                  ) -> tuple[TrainConfig, Plan]:
    """The config with the planner's best layout for ``world`` devices applied: the
    layout's fields are the config's, under the same names."""
    global_batch = requested_global_batch(config, world)
    if global_batch % world:
        raise UserError(f"--global-batch {global_batch} does not divide over {world} "
                        "processes.")
    # The planner has no fp8 model: it plans fp8 runs as bf16 ones, whose memory they about
    # match and whose step time bounds theirs from above.
    precision = "bf16" if config.precision == "fp8" else config.precision
    wanted = dataclasses.replace(config, batch_size=global_batch // world, grad_accum=1,
                                 precision=precision)
    plan = choose_plan(workload, wanted, world)
    layout = plan.layout
    batch_size: int | str = "auto" if config.batch_size == "auto" else layout.micro_batch
    chosen = dataclasses.replace(
        config, strategy=layout.strategy, dp=layout.dp, tp=layout.tp, pp=layout.pp,
        reshard_after_forward=layout.reshard_after_forward, fsdp_wrap=layout.fsdp_wrap,
        activation_checkpointing=layout.activation_checkpointing,
        batch_size=batch_size, grad_accum=layout.grad_accum, global_batch=global_batch)
    return chosen, plan


@dataclass(frozen=True)
class BatchProbe:
    """What `--batch-size auto` found and how."""

    micro_batch: int
    grad_accum: int
    largest_fitting: int
    memory_cap_bytes: int | None
    reserved_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def probe_batch_size(model: nn.Module, example: Batch, loss_step: Callable[[Batch], None],
                     config: TrainConfig, strategy: str, dp: int, device: torch.device,
                     agree: Callable[[int], int] | None) -> BatchProbe:
    """Largest micro-batch whose forward and backward fit, then the accumulation that keeps
    the global batch.

    Runs before the model is wrapped: each rank holds the whole model under single and DDP
    only, so other strategies are refused (their memory depends on shards that do not
    exist yet). The optimizer state (and DDP's gradient buckets) is reserved up front:
    ``OPTIMIZER_STATE_BYTES`` per trained parameter, as the planner counts it; frozen ones
    (a LoRA run's base) have neither.
    """
    if strategy not in _PROBED_STRATEGIES:
        raise UserError(
            f"--batch-size auto probes one whole model per device, which {strategy} does not "
            "hold; give --batch-size N, or use --strategy single or ddp."
        )
    global_batch = requested_global_batch(config, dp)
    if global_batch % dp:
        raise UserError(f"--global-batch {global_batch} does not divide over {dp} "
                        "data-parallel ranks.")
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    trained = [p for p in params if p.requires_grad]
    reserved = (sum(p.numel() for p in trained) * OPTIMIZER_STATE_BYTES[config.optimizer]
                + (sum(p.numel() * p.element_size() for p in trained)
                   if strategy == "ddp" else 0))
    cap = _memory_cap(config, device)

    def step(rows: int) -> None:
        loss_step(resize_rows(example, rows))

    budget = None if cap is None else cap - reserved
    if budget is not None and budget <= param_bytes:
        raise UserError(
            f"--memory-cap-gib {cap / 2**30:.3g} leaves no room for activations after the "
            f"weights and optimizer state ({(param_bytes + reserved) / 2**30:.3g} GiB)."
        )
    reserve = torch.empty(reserved, dtype=torch.uint8, device=device) if cap is None else None
    try:
        largest = find_max_batch_size(step, device=device, tracked=[model],
                                      memory_cap=budget, limit=global_batch // dp,
                                      agree=agree)
    finally:
        del reserve
    if device.type == "cuda":  # the run reports its own peak, not the probe's
        torch.cuda.reset_peak_memory_stats(device)
    micro, accum = accumulation_for(global_batch, dp, largest)
    return BatchProbe(micro, accum, largest, cap, reserved)


def _memory_cap(config: TrainConfig, device: torch.device) -> int | None:
    """Bytes the step may use; None on a GPU without a cap, whose allocator says when
    memory runs out."""
    if config.memory_cap_gib is not None:
        return int(config.memory_cap_gib * 2**30)
    if device.type == "cuda":
        return None
    available = total_memory()
    if available is None:
        raise UserError("--batch-size auto on this CPU needs --memory-cap-gib: the machine's "
                        "memory could not be read.")
    return int(0.9 * available)
