"""Tensor parallelism with DTensor: a plan names how each linear layer is split.

Column-wise layers split their output features across the ``tp`` mesh dimension and hand
local shards on; the row-wise layer that follows consumes those shards and all-reduces its
output, so one block costs two all-reduces in forward and two in backward, and the model
code runs unchanged on local tensors.

With sequence parallelism the norms, dropout and residual stream between those regions are
split along the sequence instead of being computed in full on every rank: each all-reduce
becomes a reduce-scatter plus an all-gather (the same traffic) and that activation memory
is divided by the tensor-parallel degree.

DTensor issues its collectives asynchronously (functional collectives) and waits where a
result is first used; ``gpuflow.telemetry.waits`` times those waits.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from gpuflow.errors import UserError
from gpuflow.parallel.single import Single
from gpuflow.parallel.strategy import ModelParts
from gpuflow.telemetry import waits as timed_waits


def transformer_plan(attention: str = "attn", mlp: str = "mlp", qkv: str = "qkv",
                     out: str = "proj", fc: str = "fc", norms: tuple[str, str] = ("ln1", "ln2"),
                     sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The Megatron split of a pre-norm transformer block, keyed relative to the block.

    The fused qkv projection must lay its outputs out head by head, so that a column shard
    holds whole heads with their q, k and v. ``sequence_parallel`` also splits the
    ``norms`` and the residual stream along the sequence (dimension 1), which must then be
    divisible by the tensor-parallel degree.
    """
    if not sequence_parallel:
        return {
            f"{attention}.{qkv}": ColwiseParallel(),
            f"{attention}.{out}": RowwiseParallel(),
            f"{mlp}.{fc}": ColwiseParallel(),
            f"{mlp}.{out}": RowwiseParallel(),
        }
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                use_local_output=True)
    return {
        norms[0]: SequenceParallel(),
        attention: gather,
        f"{attention}.{qkv}": ColwiseParallel(),
        f"{attention}.{out}": RowwiseParallel(output_layouts=Shard(1)),
        norms[1]: SequenceParallel(),
        mlp: gather,
        f"{mlp}.{fc}": ColwiseParallel(),
        f"{mlp}.{out}": RowwiseParallel(output_layouts=Shard(1)),
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
    _check_splittable(blocks[0], plan, tp_mesh.size())
    for block in blocks:
        parallelize_module(block, tp_mesh, dict(plan))
    if any(isinstance(style, SequenceParallel) for style in plan.values()):
        # The residual stream stays split along the sequence from the first block's input
        # to the last block's output, where the rest of the model gets it whole again.
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
            use_local_output=True))
        parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)))



def _check_splittable(block: nn.Module, plan: Mapping[str, ParallelStyle], degree: int) -> None:
    """Name the layer a plan cannot split, before DTensor fails somewhere inside."""
    for name, style in plan.items():
        try:
            layer = block.get_submodule(name)
        except AttributeError:
            raise UserError(f"The tensor-parallel plan names {name!r}, which the repeated "
                            f"block {type(block).__name__} does not have.") from None
        split = ("out_features" if isinstance(style, ColwiseParallel) else
                 "in_features" if isinstance(style, RowwiseParallel) else None)
        if split is None:
            continue
        if not isinstance(layer, nn.Linear | nn.Embedding):
            raise UserError(f"The tensor-parallel plan splits {name!r}, a "
                            f"{type(layer).__name__}; DTensor splits nn.Linear and "
                            "nn.Embedding layers only.")
        size = getattr(layer, split, None)
        if isinstance(size, int) and size % degree:
            raise UserError(f"{name!r} has {size} {split.replace('_', ' ')}, which --tp "
                            f"{degree} cannot split evenly; pick a degree that divides it.")


class TensorParallel(Single):
    """``--strategy tp``: each block's linear layers split over the ``tp`` ranks by the
    workload's plan (and the base for FSDP, which runs TP inside when ``tp`` > 1)."""

    def wrap(self, model: nn.Module, parts: ModelParts) -> nn.Module:
        if self.dims.tp > 1:
            assert self.mesh is not None
            apply_tensor_parallel(parts.blocks(), parts.tensor_plan(self.dims.tp),
                                  self.mesh["tp"])
        return super().wrap(model, parts)

    def untimed_waits(self) -> list[timed_waits.Wait] | None:
        if self.dims.tp == 1:
            return []
        return None if self.compile_requested else timed_waits.functional_collective_waits()
