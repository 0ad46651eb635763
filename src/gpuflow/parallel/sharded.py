"""Sharded data parallelism (``--strategy fsdp``): FSDP2's ``fully_shard`` per repeated block
and at the root splits parameters, gradients and optimizer state over the data-parallel
ranks, with tensor parallelism inside when ``tp`` > 1."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gpuflow import nf4
from gpuflow.errors import UserError
from gpuflow.parallel.strategy import ModelParts
from gpuflow.parallel.tensor import TensorParallel
from gpuflow.telemetry import waits as timed_waits

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


class Sharded(TensorParallel):
    """FSDP2 over ``dp``, after TP and activation checkpointing. Gradient reduction is
    switched off on accumulation steps; on a GPU its waits for gathers and reductions are
    timed, on the CPU its collectives themselves (they hold the host)."""

    supports_loss_scaling = False

    def wrap(self, model: nn.Module, parts: ModelParts) -> nn.Module:
        model = super().wrap(model, parts)
        dims = self.dims
        apply_fsdp(model, parts.blocks(), self.policy.autocast_dtype,
                   dims.reshard_after_forward,
                   mesh=self.mesh["dp"] if self.mesh is not None else None,
                   blocking_comm=self.host_collective_timer(), wrap=dims.fsdp_wrap,
                   prefetch=dims.fsdp_prefetch)
        return model

    def no_backward_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        self.model.set_requires_gradient_sync(last)  # an FSDPModule once wrapped
        return contextlib.nullcontext()

    def untimed_waits(self) -> list[timed_waits.Wait] | None:
        waits = super().untimed_waits()
        if waits is None or self.device.type == "cpu":
            return waits
        return waits + timed_waits.fsdp_waits()


def kept_in_fp32(model: nn.Module) -> list[nn.Module]:
    """Modules whose parameters stay fp32 under FSDP's low-precision parameters: batch norms,
    whose kernels want their weights in the dtype of their fp32 running statistics (FSDP1's
    default too)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], param_dtype: torch.dtype | None,
               reshard_after_forward: bool, mesh: DeviceMesh | None = None,
               blocking_comm: Callable[[], AbstractContextManager[None]] | None = None,
               wrap: str = "block", prefetch: int | None = None) -> nn.Module:
    """Shard each block (``wrap="block"``) or nothing but the whole model (``"model"``),
    then the root; low-precision params with fp32 gradient reduction.

    A block is gathered just before it runs, so per-block units hold one block's parameters
    at a time and, with streams, overlap the next gather with compute; each unit costs its
    own collectives and a point where all ranks wait for each other. One unit for the model
    gathers everything in one all-gather and reduces in one collective.

    ``reshard_after_forward=True`` frees a block's gathered parameters after forward and
    gathers them again in backward (ZeRO-3-like); False keeps them until backward
    (ZeRO-2-like). The root is never resharded after forward: backward needs its parameters
    (the head) first. ``blocking_comm``, for a model on the CPU, times the collectives that
    hold the host (see ``gpuflow.telemetry.host_collectives``). ``prefetch`` blocks ahead are
    gathered explicitly (see :func:`prefetch_blocks`).
    """
    if wrap == "block" and not blocks:
        raise UserError(
            "--strategy fsdp shards per repeated block, and this workload has none: give the "
            "model an nn.ModuleList attribute `blocks`, set Workload(repeated_blocks=...), or "
            "shard the model as one unit with --fsdp-wrap model."
        )
    if prefetch is not None and wrap != "block":
        raise UserError(
            f"--fsdp-prefetch {prefetch} gathers the next blocks early, and --fsdp-wrap "
            f"{wrap} makes the model one unit with no blocks to prefetch: drop --fsdp-prefetch "
            "or shard per block (--fsdp-wrap block)."
        )
    nf4.check_shards(model, mesh.size() if mesh is not None else dist.get_world_size())
    # Imported here: FSDP (with DTensor) adds ~45 MB to every process that imports it.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # Each module kept in fp32 is a unit of its own. Its input is left as it comes, as under
    # autocast alone: batch norm takes a bf16 input with fp32 weights and returns bf16, so
    # nothing fp32 is saved for backward.
    low_precision = param_dtype not in (None, torch.float32)
    norms = kept_in_fp32(model) if low_precision else []
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)
    units = [*norms, *(blocks if wrap == "block" else []), model]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=fp32 if unit in norms else policy,
                    reshard_after_forward=reshard_after_forward and unit is not model)
    if prefetch is not None:
        prefetch_blocks(blocks, prefetch)  # type: ignore[arg-type]
    if blocking_comm is not None:
        from gpuflow.telemetry.host_collectives import use_host_collectives

        use_host_collectives(units, blocking_comm)  # type: ignore[arg-type]
    return model


def prefetch_blocks(blocks: list[FSDPModule], depth: int) -> None:
    """Each block's forward starts the all-gathers of the next ``depth`` blocks, and its
    backward those of the ``depth`` blocks before it (backward's next ones).

    FSDP's own prefetch gathers one block ahead, and in forward only when the host runs ahead
    of the device: a host-bound step, or a link slower than a block's compute, leaves the
    gathers exposed. Explicit prefetch issues them regardless, at the cost of ``depth`` more
    blocks' parameters gathered at once.
    """
    for index, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[index + 1:index + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(0, index - depth):index][::-1])
