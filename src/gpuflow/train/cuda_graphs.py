"""``--cuda-graphs``: each step's forward and backward replayed as CUDA graphs.

A small model's step is launch-bound: the GPU waits on the host to issue hundreds of short
kernels. torch.compile's ``mode="reduce-overhead"`` records the compiled forward and backward
as CUDA graphs (cudagraph trees) and replays them with one launch each. A graph replays fixed
shapes and fixed memory addresses, so the run must meet three conditions, checked here
before any compile: one process (``gpuflow.config_checks``) on a CUDA device, and
batches that never change shape (a new shape would record, and hold memory for, another
graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from gpuflow.errors import UserError

# How many batches, spread over the dataset, are compared before the run starts, and their
# size: enough samples for a padded length to vary.
SHAPE_PROBES = 3
PROBE_BATCH = 8

def shapes(batch: Any) -> tuple[tuple[int, ...], ...]:
    """The shape of every tensor in ``batch``, in a fixed order."""
    return tuple(tuple(leaf.shape) for leaf in tree_leaves(batch)
                 if isinstance(leaf, torch.Tensor))


def check_static_shapes(dataset: Any, collate: Any, name: str,
                        batch_size: int = PROBE_BATCH) -> None:
    """Collate a few micro-batches from across the dataset and compare their shapes.

    A dataset without ``len`` or indexing (a stream) is not probed here; ``StaticShapes``
    still stops the run at the first batch of another shape.
    """
    try:
        count = len(dataset)
    except TypeError:
        return
    if count < batch_size or not hasattr(dataset, "__getitem__"):
        return
    starts = sorted({(count - batch_size) * i // (SHAPE_PROBES - 1)
                     for i in range(SHAPE_PROBES)})
    seen = [shapes(collate([dataset[i] for i in range(start, start + batch_size)]))
            for start in starts]
    other = next((s for s in seen if s != seen[0]), None)
    if other is not None:
        raise UserError(
            f"--cuda-graphs replays fixed shapes, but workload {name!r} makes batches of "
            f"different shapes ({_show(seen[0])} and {_show(other)}; padded to each batch's "
            "longest sample?). Drop --cuda-graphs, or pad every batch to one length.")


def check_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise UserError(
            f"--cuda-graphs records CUDA graphs and needs a CUDA device; this run is on "
            f"{device.type}. Drop --cuda-graphs (--compile alone works here).")


def _show(batch_shapes: Sequence[tuple[int, ...]]) -> str:
    return ", ".join(str(list(shape)) for shape in batch_shapes)


class StaticShapes(nn.Module):
    """Calls the graphed model, first marking a new step (so a graph's output buffers may be
    reused) and refusing inputs of a shape other than the first's."""

    def __init__(self, graphed: nn.Module) -> None:
        super().__init__()
        self.graphed = graphed
        self._shapes: tuple[tuple[int, ...], ...] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        seen = shapes((args, kwargs))
        if self._shapes is None:
            self._shapes = seen
        elif seen != self._shapes:
            raise UserError(
                f"--cuda-graphs: a batch of shape {_show(seen)} after batches of "
                f"{_show(self._shapes)}; CUDA graphs replay one shape. Drop --cuda-graphs, or "
                "pad every batch to one length.")
        torch.compiler.cudagraph_mark_step_begin()
        return self.graphed(*args, **kwargs)


def graph(model: nn.Module) -> nn.Module:
    """``model`` compiled whole with CUDA graphs, behind the shape guard."""
    return StaticShapes(torch.compile(model, mode="reduce-overhead"))
