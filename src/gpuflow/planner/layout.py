"""A candidate way to run a training step: the device mesh and everything memory depends on."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

STRATEGIES = ("single", "ddp", "fsdp", "tp")
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 4}


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the run fixes and every candidate layout keeps: not a dimension of the search."""

    optimizer: str = "adamw"
    bucket_mb: float | None = None  # DDP's gradient buckets; None: PyTorch's 25 MiB
    fsdp_prefetch: int | None = None  # blocks FSDP gathers ahead; None: its own, one

    @classmethod
    def of(cls, config_like: Any) -> RunSettings:
        """From a TrainConfig or anything with some of its fields; the rest default."""
        return cls(**{f.name: getattr(config_like, f.name, f.default)
                      for f in fields(RunSettings)})


DEFAULT_SETTINGS = RunSettings()


@dataclass(frozen=True)
class Layout(RunSettings):
    """``dp`` x ``tp`` x ``pp`` ranks; ``strategy`` says how the ``dp`` replicas hold state.

    ``strategy`` is ``single`` (one rank), ``ddp`` (replicas), ``fsdp`` (sharded across
    ``dp``) or ``tp`` (tensor parallel alone); ``pp`` > 1 adds pipeline stages under any of
    them. ``micro_batch`` is per data-parallel rank; ``grad_accum`` micro-batches make one
    step (the pipeline's micro-batches when ``pp`` > 1). FSDP's unit is each block, or with
    ``fsdp_wrap="model"`` the whole model, which is never resharded after forward. The
    run's settings (keyword-only) come with it.
    """

    strategy: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    reshard_after_forward: bool = True
    fsdp_wrap: str = "block"
    precision: str = "fp32"
    activation_checkpointing: bool = False
    micro_batch: int = 1
    grad_accum: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def resharded_blocks(self) -> bool:
        """FSDP frees each block's gathered parameters after forward and gathers them again."""
        return (self.strategy == "fsdp" and self.reshard_after_forward
                and self.fsdp_wrap == "block")

    @property
    def low_precision(self) -> bool:
        return self.precision in ("bf16", "fp16")

    def describe(self) -> str:
        mesh = f"dp{self.dp}xtp{self.tp}xpp{self.pp}"
        name = self.strategy
        if self.strategy == "fsdp" and self.fsdp_wrap == "model":
            name += "(model)"
        elif self.strategy == "fsdp":
            name += "" if self.reshard_after_forward else "(no-reshard)"
        return f"{name} {mesh}"
