"""Typed training configuration: defaults, then a TOML file, then explicit CLI flags."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from gpuflow.errors import UserError

# DistributedDataParallel's gradient bucket size when --bucket-mb is not given.
DDP_DEFAULT_BUCKET_MIB = 25.0

Precision = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
Fp8Recipe = Literal["tensorwise", "rowwise"]
OptimizerName = Literal["adamw", "sgd"]
Schedule = Literal["cosine", "constant"]
Strategy = Literal["single", "ddp", "fsdp", "tp", "pp", "auto"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
PipelineSplit = Literal["auto", "trace", "manual"]
FsdpWrap = Literal["block", "model"]
DataSource = Literal["real", "synthetic"]
DEFAULT_BATCH_SIZE = 64
DEFAULT_EVAL_BATCHES = 20  # see gpuflow.data.eval_set


def stages_per_rank(schedule: str) -> int:
    """Pipeline stages each rank holds: two with the interleaved schedule."""
    return 2 if schedule == "interleaved-1f1b" else 1


@dataclass
class TrainConfig:
    """Everything a training run needs besides the workload itself."""

    workload: str = "digits"
    data_dir: str | None = None
    data: DataSource = "real"
    model_size: str | None = None
    val_speakers: str | None = None
    device: str = "auto"
    precision: Precision = "fp32"
    batch_size: int | Literal["auto"] = DEFAULT_BATCH_SIZE
    fp8_recipe: Fp8Recipe = "tensorwise"
    global_batch: int | None = None
    memory_cap_gib: float | None = None
    grad_accum: int = 1
    lr: float = 3e-3
    optimizer: OptimizerName = "adamw"
    weight_decay: float = 0.01
    schedule: Schedule = "cosine"
    warmup_steps: int = 20
    max_steps: int | None = None
    epochs: float | None = None
    eval_every: int = 100
    eval_batches: int = DEFAULT_EVAL_BATCHES
    log_every: int = 10
    compile: bool = False
    activation_checkpointing: bool = False
    cuda_graphs: bool = False
    clip_grad: float | None = None
    seed: int = 0
    run_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    save_checkpoints: bool = True
    resume: str | bool = False
    num_workers: int = 0
    max_nonfinite_steps: int = 20
    tensorboard: bool = False
    progress: bool = True
    strategy: Strategy | None = None
    reshard_after_forward: bool = True
    fsdp_wrap: FsdpWrap = "block"
    bucket_mb: float | None = None
    fsdp_prefetch: int | None = None
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    pp_schedule: PipelineSchedule = "1f1b"
    pp_split: PipelineSplit = "auto"
    microbatches: int | None = None
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Reject values that would fail later with an unhelpful traceback."""
        _check_choice("precision", self.precision, Precision)
        _check_choice("optimizer", self.optimizer, OptimizerName)
        _check_choice("fp8_recipe", self.fp8_recipe, Fp8Recipe)
        _check_choice("schedule", self.schedule, Schedule)
        _check_choice("data", self.data, DataSource)
        _check_choice("pp_schedule", self.pp_schedule, PipelineSchedule)
        _check_choice("pp_split", self.pp_split, PipelineSplit)
        _check_choice("fsdp_wrap", self.fsdp_wrap, FsdpWrap)
        if self.strategy is not None:
            _check_choice("strategy", self.strategy, Strategy)
        if self.batch_size != "auto" and self.batch_size < 1:
            raise UserError(f"--batch-size must be at least 1 or auto (got {self.batch_size}).")
        for name in ("grad_accum", "log_every", "keep_checkpoints",
                     "max_nonfinite_steps", "nproc", "nnodes", "tp", "pp"):
            if getattr(self, name) < 1:
                raise UserError(f"--{_flag(name)} must be at least 1 (got {getattr(self, name)}).")
        for name in ("eval_every", "eval_batches", "checkpoint_every", "num_workers",
                     "warmup_steps", "max_restarts", "node_rank"):
            if getattr(self, name) < 0:
                raise UserError(f"--{_flag(name)} must be 0 or more (got {getattr(self, name)}).")
        if self.lr <= 0:
            raise UserError(f"--lr must be positive (got {self.lr}).")
        if self.bucket_mb is not None and self.bucket_mb <= 0:
            raise UserError(f"--bucket-mb must be positive (got {self.bucket_mb}).")
        if self.fsdp_prefetch is not None and self.fsdp_prefetch < 1:
            raise UserError(f"--fsdp-prefetch must be at least 1 (got {self.fsdp_prefetch}); "
                            "leave it unset for FSDP's own one-block prefetch.")
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"--max-steps must be at least 1 (got {self.max_steps}).")
        if self.epochs is not None and self.epochs <= 0:
            raise UserError(f"--epochs must be positive (got {self.epochs}).")
        if self.max_steps is not None and self.epochs is not None:
            raise UserError("Give either --max-steps or --epochs, not both.")
        if self.checkpoint_every and not self.save_checkpoints:
            raise UserError("--checkpoint-every and --no-checkpoints contradict each other; "
                            "drop one.")
        if self.max_restarts and not self.save_checkpoints:
            raise UserError("--max-restarts resumes restarted workers from the last "
                            "checkpoint, which --no-checkpoints never writes; drop one.")
        if self.clip_grad is not None and self.clip_grad <= 0:
            raise UserError(f"--clip-grad must be positive (got {self.clip_grad}).")
        if self.memory_cap_gib is not None and self.memory_cap_gib <= 0:
            raise UserError(f"--memory-cap-gib must be positive (got {self.memory_cap_gib}).")
        for name in ("dp", "microbatches", "global_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{_flag(name)} must be at least 1 (got {value}).")

        if (self.precision == "fp8" or self.cuda_graphs) and self.strategy != "auto":
            self.check_step_modes(self.resolved_strategy(self.nproc * self.nnodes),
                                  self.tp, self.pp)

    def check_step_modes(self, strategy: str, tp: int, pp: int) -> None:
        """fp8 and CUDA graphs only with the strategies they compose with."""
        if self.precision == "fp8" and (tp > 1 or pp > 1 or strategy in ("tp", "pp")):
            raise UserError(
                "--precision fp8 composes with --strategy single, ddp and fsdp; tensor and "
                "pipeline parallelism would need torchao's float8 parallel styles, which "
                f"gpuflow does not apply (this run: --strategy {strategy}"
                f"{f' --tp {tp}' if tp > 1 else ''}{f' --pp {pp}' if pp > 1 else ''}). Use "
                "--precision bf16 with them.")
        if self.cuda_graphs and (self.grad_accum > 1 or self.batch_size == "auto"):
            asked = ("--batch-size auto, which may accumulate micro-batches" if
                     self.batch_size == "auto" else f"--grad-accum {self.grad_accum}")
            raise UserError(
                f"--cuda-graphs with {asked}: the captured backward writes each micro-step's "
                "gradients into memory that the next replay reuses (torch's cudagraph trees), "
                "so they cannot accumulate. Use --grad-accum 1 and a --batch-size N.")
        if self.cuda_graphs and strategy != "single":
            raise UserError(
                f"--cuda-graphs runs with --strategy single only: with --strategy {strategy}, "
                f"{_UNGRAPHABLE[strategy]}, which one captured graph cannot replay. Drop "
                "--cuda-graphs, or train on one GPU.")
    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        """(data-parallel, tensor-parallel, pipeline-parallel) degrees; their product is the
        world size. ``tp`` and ``pp`` alone take every process unless given."""
        strategy = self.resolved_strategy(world_size)
        tp = world_size if strategy == "tp" and self.tp == 1 else self.tp
        pp = world_size if strategy == "pp" and self.pp == 1 else self.pp
        if tp > 1 and pp > 1:
            raise UserError(
                f"--tp {tp} with --pp {pp}: tensor parallelism inside pipeline stages is not "
                "supported; compose pipeline parallelism with fsdp (--strategy fsdp --pp N)."
            )
        if world_size % (tp * pp):
            raise UserError(
                f"--tp {tp} x --pp {pp} does not divide the {world_size} processes of this job."
            )
        dp = world_size // (tp * pp)
        if self.dp is not None and self.dp != dp:
            raise UserError(
                f"--dp {self.dp} x --tp {tp} x --pp {pp} must equal the {world_size} processes "
                f"of this job (dp would be {dp})."
            )
        if strategy in ("tp", "pp") and dp != 1:
            model_parallel = tp if strategy == "tp" else pp
            raise UserError(
                f"--strategy {strategy} with --{strategy} {model_parallel} on {world_size} "
                f"processes leaves {dp} data-parallel replicas: use --strategy fsdp "
                f"--{strategy} N to shard data across them."
            )
        if (tp > 1 or pp > 1) and strategy in ("ddp", "single"):
            flag = f"--tp {tp}" if tp > 1 else f"--pp {pp}"
            raise UserError(
                f"{flag} with --strategy {strategy}: model parallelism composes with fsdp "
                f"(--strategy fsdp {flag.split()[0]} N) or runs alone (--strategy "
                f"{'tp' if tp > 1 else 'pp'})."
            )
        return dp, tp, pp

    def resolved_strategy(self, world_size: int) -> str:
        """Data-parallel by default when there is more than one process."""
        if self.strategy is not None:
            if self.strategy == "single" and world_size > 1:
                raise UserError(
                    f"--strategy single runs one process, but this job has {world_size}; "
                    "use --strategy ddp or fsdp, or drop --nproc."
                )
            return self.strategy
        return "ddp" if world_size > 1 else "single"

    def workload_options(self) -> dict[str, Any]:
        """What the workload factory is given: only the options the user actually set."""
        options: dict[str, Any] = {}
        if self.data_dir is not None:
            options["data_dir"] = self.data_dir
        if self.data != "real":
            options["data"] = self.data
        if self.model_size is not None:
            options["model_size"] = self.model_size
        if self.val_speakers is not None:
            options["val_speakers"] = self.val_speakers
        return options

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")

# Why a captured CUDA graph cannot replay a step of each multi-process strategy.
_UNGRAPHABLE = {
    "ddp": "DDP all-reduces gradient buckets from autograd hooks while backward runs",
    "fsdp": "FSDP2 gathers, frees and allocates parameters around each block",
    "tp": "tensor parallelism runs collectives inside each block",
    "pp": "the pipeline schedule sends activations between ranks between micro-steps",
}



def _check_choice(name: str, value: object, literal: object) -> None:
    choices = get_args(literal)
    if value not in choices:
        raise UserError(f"--{_flag(name)} must be one of {', '.join(choices)} (got {value!r}).")


FIELD_NAMES = frozenset(f.name for f in fields(TrainConfig)) - {"extra"}


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config; keys are the long flag names with '-' or '_'."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"Config file {path} does not exist.") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"Config file {path} is not valid TOML: {exc}.") from None
    values = {key.replace("-", "_"): value for key, value in raw.items()}
    unknown = sorted(set(values) - FIELD_NAMES)
    if unknown:
        raise UserError(
            f"Config file {path} has unknown keys: {', '.join(unknown)}. "
            f"Known keys are the `gpuflow train` flags: {', '.join(sorted(FIELD_NAMES))}."
        )
    return values


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Merge defaults < TOML file < flags and validate the result."""
    merged = {**file_values, **flag_values}
    try:
        config = TrainConfig(**merged)
    except TypeError as exc:
        raise UserError(f"Invalid configuration: {exc}.") from None
    _check_types(config)
    config.validate()
    return config


def _check_types(config: TrainConfig) -> None:
    """TOML can carry a string where a number belongs; say so plainly."""
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        value, default = getattr(config, f.name), getattr(defaults, f.name)
        if value is None or f.name in ("resume", "extra"):
            continue
        expected = type(default) if default is not None else None
        if f.name in ("max_steps",):
            expected = int
        elif f.name in ("strategy", "rdzv_endpoint", "data_dir", "model_size",
                        "val_speakers"):
            expected = str
        elif f.name in ("dp", "microbatches", "global_batch", "fsdp_prefetch"):
            expected = int
        elif f.name in ("memory_cap_gib", "bucket_mb"):
            expected = float
        elif f.name == "batch_size" and value == "auto":
            continue
        elif f.name in ("epochs", "clip_grad"):
            expected = float
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, f.name, float(value))
            continue
        wrong_bool = isinstance(value, bool) and expected is not bool
        if expected is not None and (wrong_bool or not isinstance(value, expected)):
            raise UserError(
                f"`{f.name}` must be of type {expected.__name__} (got {value!r})."
            )
