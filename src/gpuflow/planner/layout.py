"""A candidate way to run a training step: the trainer's parallel layout and everything else
memory and time depend on."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from gpuflow.parallel.dims import ParallelDims

# Optimizer state per parameter, bytes: fp32 in every precision (AdamW's two moments, SGD's
# momentum buffer).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 4}


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the run fixes and every candidate layout keeps: not a dimension of the search."""

    optimizer: str = "adamw"
    bucket_mb: float | None = None  # DDP's gradient buckets; None: PyTorch's 25 MiB
    fsdp_prefetch: int | None = None  # blocks FSDP gathers ahead; None: its own, one
    lora_rank: int | None = None  # adapters train, on a frozen base: fewer layouts run them
    quantize_base: str | None = None  # that base held as NF4

    @classmethod
    def of(cls, config_like: Any) -> RunSettings:
        """From a TrainConfig or anything with some of its fields; the rest default."""
        return cls(**{f.name: getattr(config_like, f.name, f.default) for f in fields(cls)})


DEFAULT_SETTINGS = RunSettings()


@dataclass(frozen=True, kw_only=True)
class Layout(ParallelDims):
    """A :class:`ParallelDims` the trainer runs, with what else a step's memory and time
    depend on: the precision, activation checkpointing, the optimizer, and ``micro_batch``
    samples per data-parallel rank times ``grad_accum`` micro-batches per step (a
    pipeline's micro-batches when ``pp`` > 1)."""

    precision: str = "fp32"
    activation_checkpointing: bool = False
    micro_batch: int = 1
    grad_accum: int = 1
    optimizer: str = "adamw"

    @property
    def samples_per_step(self) -> int:
        """The global batch: samples per optimizer step over all data-parallel replicas."""
        return self.global_batch(self.micro_batch, self.grad_accum)

    @property
    def low_precision(self) -> bool:
        return self.precision in ("bf16", "fp16")
