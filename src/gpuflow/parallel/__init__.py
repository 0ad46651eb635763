"""Scale-out on torch.distributed: process groups, the elastic launcher, DDP and FSDP2.

Each layout (:attr:`ParallelDims.family <gpuflow.parallel.dims.ParallelDims.family>`) is run
by one :class:`~gpuflow.parallel.strategy.Strategy` subclass, named in :data:`STRATEGIES` and
imported only when a run needs it: each pulls in only its own part of torch.distributed
(pipelining and FSDP add tens of MB to a process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gpuflow.parallel.dims import ParallelDims
    from gpuflow.parallel.strategy import Strategy
    from gpuflow.precision import PrecisionPolicy
    from gpuflow.telemetry.steps import StepTimer

STRATEGIES = {
    "single": "gpuflow.parallel.single:Single",
    "ddp": "gpuflow.parallel.replicated:Replicated",
    "tp": "gpuflow.parallel.tensor:TensorParallel",
    "fsdp": "gpuflow.parallel.sharded:Sharded",
    "pp": "gpuflow.parallel.pipelined:Pipelined",
}


def strategy_class(family: str) -> type[Strategy]:
    """The class that runs a layout of ``family``."""
    module, _, name = STRATEGIES[family].partition(":")
    return getattr(importlib.import_module(module), name)


def build_strategy(dims: ParallelDims, device: torch.device, policy: PrecisionPolicy,
                   timer: StepTimer, compile: bool = False) -> Strategy:
    """The strategy that runs ``dims``, before the model is wrapped."""
    return strategy_class(dims.family)(dims, device, policy, timer, compile)
