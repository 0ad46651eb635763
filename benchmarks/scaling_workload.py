"""The compute-heavy workload ``benchmarks/scaling.py`` trains through ``gpuflow train``.

A residual MLP whose blocks sit in ``blocks`` (an ``nn.ModuleList``, the unit FSDP shards
on), trained on seeded synthetic data: about 2.1 M parameters (8.4 MB of fp32 gradients to
all-reduce per step) and 12.6 MFLOP per sample (forward and backward). Communication per step
is fixed by the parameter count while compute grows with the micro-batch. The benchmark's
default micro-batch of 2048 per rank (25.8 GFLOP, ~0.55 s per step on one AMD EPYC thread)
does 3,100 FLOP per byte of gradient; 512 does 770, so communication-heavy that the exposed
all-reduce took 15% of a DDP step (30 of 199 ms). Real data-parallel jobs sit far above both: GPT-2
124M at 0.5 M tokens per step does ~7 x 10^8.

Imported as ``scaling_workload:build`` with ``benchmarks/`` on PYTHONPATH.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpuflow

FEATURES = 256
HIDDEN = 1024
BLOCKS = 4
CLASSES = 10
SAMPLES = 4096
SEED = 0


class Block(nn.Module):
    """Pre-norm residual MLP block: two matmuls carry almost all of its FLOPs."""

    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(features)
        self.up = nn.Linear(features, hidden)
        self.down = nn.Linear(hidden, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class ScalingMLP(nn.Module):
    """Residual MLP classifier; ``blocks`` lets FSDP shard per block."""

    def __init__(self, features: int = FEATURES, hidden: int = HIDDEN, blocks: int = BLOCKS,
                 classes: int = CLASSES) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(features, hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(features)
        self.head = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def synthetic_data(samples: int = SAMPLES, features: int = FEATURES, classes: int = CLASSES,
                   seed: int = SEED) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random linear teacher, so the loss can fall."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    teacher = torch.randn(features, classes, generator=generator)
    return TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def build() -> gpuflow.Workload:
    """The factory ``gpuflow train --workload scaling_workload:build`` calls."""
    return gpuflow.Workload(name="scaling-mlp", model=ScalingMLP(),
                            train_dataset=synthetic_data())
