"""``--compile``: regional compilation of the repeated blocks, or the whole model, checked
by a trial step before the run relies on it; and the step modes that need it (fp8, CUDA
graphs), refused where they cannot run."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpuflow.config import TrainConfig
from gpuflow.config_checks import check_step_modes
from gpuflow.errors import UserError
from gpuflow.parallel.dims import ParallelDims
from gpuflow.parallel.strategy import Loss
from gpuflow.precision import PrecisionPolicy
from gpuflow.train import cuda_graphs, fp8
from gpuflow.train.probe import probe_step
from gpuflow.workload import Workload


def turn_on_compile_for_step_modes(config: TrainConfig, dims: ParallelDims,
                                   device: torch.device, workload: Workload) -> TrainConfig:
    """Refuse fp8 and CUDA graphs where they cannot run (the device last, so that the other
    refusals show on a CPU too); both need --compile, which they turn on."""
    check_step_modes(config, dims.strategy, dims.tp, dims.pp)
    if config.precision == "fp8":
        fp8.check_device(device)
    if config.cuda_graphs:
        cuda_graphs.check_static_shapes(workload.train_dataset, workload.collate, workload.name)
        cuda_graphs.check_device(device)
    wanted = [flag for flag, on in (("--precision fp8", config.precision == "fp8"),
                                    ("--cuda-graphs", config.cuda_graphs)) if on]
    if not wanted or config.compile:
        return config
    one = len(wanted) == 1
    warnings.warn(f"{' and '.join(wanted)} turn{'s' * one} on --compile, which "
                  f"{'it needs' if one else 'they need'}.", stacklevel=3)
    return dataclasses.replace(config, compile=True)


@dataclass(frozen=True)
class Compiled:
    """The module the step calls once compiled, and what was compiled."""

    module: nn.Module
    scope: str


def compile_step(forward: nn.Module, model: nn.Module, blocks: list[nn.Module],
                 batch: tuple[Any, torch.Tensor], loss_fn: Loss, policy: PrecisionPolicy,
                 device: torch.device, config: TrainConfig) -> Compiled | None:
    """Compile each repeated block in place where the model has them, else the model; with
    --compile-scope model the whole model as one graph (fewer launches and fusions across
    blocks, for a longer cold compile); with --cuda-graphs the whole model, into one graph
    per step direction.

    Identical blocks share one compiled graph (PyTorch's regional compilation), so cold
    compile time does not grow with depth and parameter names stay unchanged. A trial step
    on ``batch`` (the micro-batch's shape) surfaces compiler failures here and compiles the
    graph the steps will use: the run then continues in eager mode (None), or stops under
    --cuda-graphs, which asked for graphs.
    """
    graphs = config.cuda_graphs
    blocks = [] if graphs or config.compile_scope == "model" else blocks
    try:
        if graphs:
            compiled = cuda_graphs.graph(forward)
        elif blocks:
            for block in blocks:
                block.compile()
            compiled = forward
        else:
            compiled = torch.compile(forward)
        probe_step(model, compiled, batch, loss_fn, policy, device)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        if graphs:
            raise UserError(f"--cuda-graphs: torch.compile failed to record the step "
                            f"({reason}); drop --cuda-graphs to train without graphs.") from exc
        for block in blocks:
            block._compiled_call_impl = None  # undoes nn.Module.compile()
        warnings.warn(f"torch.compile failed ({reason}); training continues in eager mode.",
                      stacklevel=3)
        return None
    scope = (f"{len(blocks)} blocks" if blocks else
             "model, as CUDA graphs" if graphs else "model")
    return Compiled(compiled, scope)
