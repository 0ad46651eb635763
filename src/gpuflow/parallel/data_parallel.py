"""Data parallelism: replicate with DDP, or shard parameters, gradients and optimizer state
with FSDP2 (``fully_shard``) per repeated block and at the root."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from gpuflow.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def apply_ddp(model: nn.Module, device: torch.device,
              on_bucket_ready: Callable[[], None] | None = None,
              bucket_mb: float | None = None) -> DistributedDataParallel:
    """Gradients are bucketed and all-reduced while backward is still running.

    A bucket is all-reduced once backward has filled it. Buckets hold ``bucket_mb`` MiB of
    gradients; by default PyTorch's 25, except the first (the last parameters' gradients,
    which backward reaches first) with 1. What is left to reduce when backward ends is
    exposed: about the last bucket, unless the link falls behind.

    ``on_bucket_ready`` is called as each bucket's all-reduce is launched; the last call of a
    backward marks the end of its gradient compute, so the time from there until backward
    returns is communication that nothing overlapped.
    """
    device_ids = [device.index] if device.type == "cuda" else None
    # Gradients live in the communication buckets: no copy into them, less memory.
    ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                  bucket_cap_mb=bucket_mb)
    if on_bucket_ready is not None:
        # No annotations: DDP compares them to dist.GradBucket, and postponed ones are strings.
        def timed_allreduce(state, bucket):
            on_bucket_ready()
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, timed_allreduce)
    return ddp


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


def set_gradient_sync(model: nn.Module, enabled: bool) -> bool:
    """Turn FSDP's per-backward gradient reduction on or off; False if not an FSDP model."""
    sync = getattr(model, "set_requires_gradient_sync", None)  # FSDPModule's
    if sync is None:
        return False
    sync(enabled)
    return True
