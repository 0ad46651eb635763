"""Tensor parallelism with DTensor: a plan names how each linear layer is split.

Column-wise layers split their output features across the ``tp`` mesh dimension and hand
local shards on; the row-wise layer that follows consumes those shards and all-reduces its
output, so one block costs two all-reduces in forward and two in backward, and the model
code runs unchanged on local tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from gpuflow.errors import UserError


def transformer_plan(attention: str = "attn", mlp: str = "mlp", qkv: str = "qkv",
                     out: str = "proj", fc: str = "fc") -> dict[str, ParallelStyle]:
    """The Megatron split of a pre-norm transformer block, keyed relative to the block.

    The fused qkv projection must lay its outputs out head by head, so that a column shard
    holds whole heads with their q, k and v.
    """
    return {
        f"{attention}.{qkv}": ColwiseParallel(),
        f"{attention}.{out}": RowwiseParallel(),
        f"{mlp}.{fc}": ColwiseParallel(),
        f"{mlp}.{out}": RowwiseParallel(),
    }


def apply_tensor_parallel(blocks: list[nn.Module], plan: Mapping[str, ParallelStyle] | None,
                          tp_mesh: DeviceMesh) -> None:
    """Split every repeated block by ``plan``; embeddings and head stay replicated."""
    if not plan:
        raise UserError(
            "Tensor parallelism needs a plan from the workload: set "
            "Workload(tensor_parallel_plan={'attn.qkv': ColwiseParallel(), ...}) with keys "
            "relative to each repeated block."
        )
    if not blocks:
        raise UserError("Tensor parallelism splits the workload's repeated blocks; it has none.")
    for block in blocks:
        parallelize_module(block, tp_mesh, dict(plan))
