"""The parallel layout of a run as one value: degrees, the strategy over them, and its knobs.

``ParallelDims`` is what the trainer builds its mesh and strategy from and what the planner
searches over, so a layout has one set of names everywhere. It checks itself on creation:
a layout that exists is one gpuflow can run.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

from gpuflow.config import TrainConfig
from gpuflow.config_checks import describe_idle, idle_layout_options
from gpuflow.config_fields import (
    FsdpWrap,
    PipelineSchedule,
    PipelineSplit,
    StrategyName,
    default_strategy,
)
from gpuflow.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

def stages_per_rank(schedule: str) -> int:
    """Pipeline stages each rank holds: two with the interleaved schedule."""
    return 2 if schedule == "interleaved-1f1b" else 1


def _check_model_parallel(tp: int, pp: int) -> None:
    if tp > 1 and pp > 1:
        raise UserError(
            f"--tp {tp} with --pp {pp}: tensor parallelism inside pipeline stages is not "
            "supported; compose pipeline parallelism with fsdp (--strategy fsdp --pp N).")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """``dp`` x ``tp`` x ``pp`` ranks and how they hold the model.

    ``strategy`` is ``single`` (one rank), ``ddp`` (whole replicas), ``fsdp`` (parameters,
    gradients and optimizer state sharded over ``dp``, with ``tp`` or ``pp`` inside), ``tp``
    (tensor parallel alone) or ``pp`` (pipeline stages alone). FSDP's unit is each repeated
    block or, with ``fsdp_wrap="model"``, the whole model (never resharded after forward);
    ``fsdp_prefetch`` blocks are gathered ahead. ``bucket_mb`` sizes DDP's gradient buckets
    (None: PyTorch's 25 MiB). ``microbatches`` is what the pipeline splits each micro-batch
    into (None: twice the stages; 1 without a pipeline).
    """

    strategy: StrategyName = "single"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    reshard_after_forward: bool = True
    fsdp_wrap: FsdpWrap = "block"
    fsdp_prefetch: int | None = None
    bucket_mb: float | None = None
    pp_schedule: PipelineSchedule = "1f1b"
    pp_split: PipelineSplit = "auto"
    microbatches: int | None = None

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def from_config(cls, config: TrainConfig, world: int) -> ParallelDims:
        """The layout a run's flags give ``world`` processes (after --strategy auto, which
        the planner resolves into these flags). Layout options it has no use for are named
        in one warning: the config refuses them when given with the layout, so these came
        with the planner's choice or a resumed run's saved options."""
        assert config.strategy != "auto"
        dims = cls.resolve(
            world, config.strategy, dp=config.dp, tp=config.tp, pp=config.pp,
            reshard_after_forward=config.reshard_after_forward, fsdp_wrap=config.fsdp_wrap,
            fsdp_prefetch=config.fsdp_prefetch, bucket_mb=config.bucket_mb,
            pp_schedule=config.pp_schedule, pp_split=config.pp_split,
            microbatches=config.microbatches)
        idle = idle_layout_options(config, dims.strategy, dims.pp)
        if idle:
            warnings.warn(f"{describe_idle(idle, dims.describe())}: ignored.", stacklevel=2)
        return dims

    @classmethod
    def resolve(cls, world: int, strategy: StrategyName | None = None, *, dp: int | None = None,
                tp: int = 1, pp: int = 1, **knobs: object) -> ParallelDims:
        """The layout that ``world`` processes run for these flags: the strategy defaults to
        DDP over several processes, and ``--strategy tp``/``pp`` alone take every process."""
        strategy = strategy or default_strategy(world)
        tp = world if strategy == "tp" and tp == 1 else tp
        pp = world if strategy == "pp" and pp == 1 else pp
        _check_model_parallel(tp, pp)
        if world % (tp * pp):
            raise UserError(
                f"--tp {tp} x --pp {pp} does not divide the {world} processes of this job.")
        replicas = world // (tp * pp)
        if dp is not None and dp != replicas:
            raise UserError(
                f"--dp {dp} x --tp {tp} x --pp {pp} must equal the {world} processes of this "
                f"job (dp would be {replicas}).")
        return cls(strategy=strategy, dp=replicas, tp=tp, pp=pp, **knobs)  # type: ignore[arg-type]

    def _check(self) -> None:
        if self.strategy not in get_args(StrategyName):
            raise UserError(f"--strategy must be one of {', '.join(get_args(StrategyName))} "
                            f"or auto (got {self.strategy!r}).")
        if self.strategy == "single" and self.world > 1:
            raise UserError(f"--strategy single runs one process, but this job has "
                            f"{self.world}; use --strategy ddp or fsdp, or drop --nproc.")
        if min(self.dp, self.tp, self.pp) < 1:
            raise UserError(f"dp {self.dp} x tp {self.tp} x pp {self.pp}: every degree must be "
                            "at least 1.")
        _check_model_parallel(self.tp, self.pp)
        if self.strategy in ("tp", "pp") and self.dp != 1:
            degree = self.tp if self.strategy == "tp" else self.pp
            raise UserError(
                f"--strategy {self.strategy} with --{self.strategy} {degree} on {self.world} "
                f"processes leaves {self.dp} data-parallel replicas: use --strategy fsdp "
                f"--{self.strategy} N to shard data across them.")
        if (self.tp > 1 or self.pp > 1) and self.strategy in ("ddp", "single"):
            flag = f"--tp {self.tp}" if self.tp > 1 else f"--pp {self.pp}"
            raise UserError(
                f"{flag} with --strategy {self.strategy}: model parallelism composes with fsdp "
                f"(--strategy fsdp {flag.split()[0]} N) or runs alone (--strategy "
                f"{'tp' if self.tp > 1 else 'pp'}).")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    @property
    def family(self) -> str:
        """The strategy family that runs this layout (:data:`gpuflow.parallel.STRATEGIES`):
        pipelines first (alone or under FSDP), then FSDP (with TP inside or not), TP alone,
        DDP, and one process's whole model."""
        if self.pipelined:
            return "pp"
        if self.sharded:
            return "fsdp"
        if self.tp > 1:
            return "tp"
        return "ddp" if self.strategy == "ddp" else "single"

    @property
    def resharded_blocks(self) -> bool:
        """FSDP frees each block's gathered parameters after forward and gathers them again."""
        return self.sharded and self.reshard_after_forward and self.fsdp_wrap == "block"

    @property
    def stages(self) -> int:
        """Pipeline stages over all ranks."""
        return self.pp * stages_per_rank(self.pp_schedule) if self.pipelined else 1

    def pipeline_microbatches(self, batch_size: int) -> int:
        """What the pipeline splits each micro-batch of ``batch_size`` into; 1 without one."""
        if not self.pipelined:
            return 1
        count = self.microbatches or 2 * self.pp
        if batch_size % count:
            raise UserError(
                f"--batch-size {batch_size} does not split into --microbatches {count}; "
                "pick a batch size that is a multiple of it.")
        if count < self.stages and self.pp_schedule != "gpipe":
            raise UserError(
                f"--pp-schedule {self.pp_schedule} needs at least as many micro-batches as "
                f"pipeline stages ({self.stages}); got --microbatches {count}.")
        return count

    def global_batch(self, micro_batch: int, grad_accum: int) -> int:
        """Samples per optimizer step over all data-parallel replicas."""
        return micro_batch * grad_accum * self.dp

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        """(dp, tp) with tensor parallelism innermost, or (pp, dp) with pipeline stages
        outermost, as torchtitan lays them out; None for data parallelism alone."""
        if self.tp > 1:
            return (self.dp, self.tp), ("dp", "tp")
        if self.pp > 1:
            return (self.pp, self.dp), ("pp", "dp")
        return None

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The DeviceMesh of :meth:`mesh_shape` over the processes of this job."""
        shape = self.mesh_shape()
        if shape is None:
            return None
        from torch.distributed.device_mesh import init_device_mesh  # torch.distributed: lazy

        return init_device_mesh(device_type, shape[0], mesh_dim_names=shape[1])

    def strategy_label(self) -> str:
        """The strategy with the FSDP unit or prefetch that sets it apart."""
        if self.sharded and self.fsdp_wrap == "model":
            return f"{self.strategy} as one unit"
        if self.sharded and self.fsdp_prefetch:
            return f"{self.strategy}, prefetch depth {self.fsdp_prefetch}"
        return self.strategy

    def describe(self) -> str:
        """For the planner's tables: ``fsdp(no-reshard) dp2xtp1xpp1``."""
        name = self.strategy
        if self.sharded and self.fsdp_wrap == "model":
            name += "(model)"
        elif self.sharded and not self.reshard_after_forward:
            name += "(no-reshard)"
        return f"{name} dp{self.dp}xtp{self.tp}xpp{self.pp}"

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def runnable(cls, dp: int, tp: int, pp: int, fsdp_prefetch: int | None = None,
                 **knobs: object) -> Iterator[ParallelDims]:
        """Every strategy gpuflow can run on a ``dp`` x ``tp`` x ``pp`` mesh: the one model-
        parallel or single-rank way when ``dp`` is 1; else FSDP resharded or not (and as one
        unit unless blocks are prefetched), and DDP where nothing else splits the model."""
        if tp > 1 and pp > 1:
            return
        if dp == 1:
            alone = "tp" if tp > 1 else "pp" if pp > 1 else "single"
            yield cls(strategy=alone, tp=tp, pp=pp, fsdp_prefetch=fsdp_prefetch, **knobs)
            return
        kinds: list[tuple[StrategyName, bool, FsdpWrap]] = [("fsdp", True, "block"),
                                                            ("fsdp", False, "block")]
        if fsdp_prefetch is None:
            kinds.append(("fsdp", False, "model"))
        if tp == 1 and pp == 1:
            kinds.append(("ddp", True, "block"))
        for strategy, reshard, wrap in kinds:
            yield cls(strategy=strategy, dp=dp, tp=tp, pp=pp, reshard_after_forward=reshard,
                      fsdp_wrap=wrap, fsdp_prefetch=fsdp_prefetch, **knobs)  # type: ignore[arg-type]
