"""The training engine: a lean step loop with telemetry, parallelism and exact resume."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import json
import math
import platform
import random
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gpuflow import checkpoint as ckpt
from gpuflow.config import TrainConfig, stages_per_rank
from gpuflow.data.eval_set import eval_set
from gpuflow.data.iterable import StreamBatches, StreamPosition, is_sized, is_stream, resume_note
from gpuflow.data.loader import batches_per_epoch, supports_batched_indexing, train_batches
from gpuflow.data.prefetch import DevicePrefetcher, move_to_device, resize_rows
from gpuflow.devices import (
    device_memory_bytes,
    device_name,
    native_bf16,
    peak_flops,
    resolve_device,
)
from gpuflow.errors import NonFiniteLossError, UserError
from gpuflow.parallel.data_parallel import apply_ddp, apply_fsdp, set_gradient_sync
from gpuflow.parallel.env import init_distributed
from gpuflow.precision import make_policy
from gpuflow.telemetry import waits as timed_waits
from gpuflow.telemetry.flops import count_flops, count_training_flops
from gpuflow.telemetry.steps import MetricsLog, StepTimer, medians, peak_memory_bytes
from gpuflow.train import cuda_graphs, fp8
from gpuflow.train.optim import build_optimizer, build_scheduler, restore_schedule
from gpuflow.train.progress import ProgressDisplay
from gpuflow.workload import Batch, Workload

if TYPE_CHECKING:
    from gpuflow.parallel.pipeline import Pipeline
    from gpuflow.planner.search import Plan
    from gpuflow.train.auto import BatchProbe

DEFAULT_EPOCHS = 10.0
RUN_FORMAT_VERSION = 1


@dataclass
class RunResult:
    """What `train()` hands back: where the run lives and how it ended."""

    run_dir: Path
    steps: int
    final_metrics: dict[str, float]
    summary: dict[str, Any]
    model: nn.Module


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


def batch_size_of(batch: Batch) -> int:
    return int(batch[1].shape[0])


@contextlib.contextmanager
def side_effect_free(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Run a probe step without disturbing RNG streams, buffers (e.g. BatchNorm) or grads."""
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, buf in model.named_buffers():
                    buf.copy_(buffers[name])
            for param in model.parameters():
                param.grad = None


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> int:
    """Wrap each repeated block so its activations are recomputed in backward."""
    if not blocks:
        raise UserError(
            "--activation-checkpointing needs repeated blocks to wrap, and this workload has "
            "none: give the model an nn.ModuleList attribute `blocks`, or set "
            "Workload(repeated_blocks=lambda model: [...])."
        )
    wanted = {id(block) for block in blocks}
    parents = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if id(child) in wanted]
    for parent, name, child in parents:
        setattr(parent, name, checkpoint_wrapper(child, preserve_rng_state=True))
    return len(parents)


def default_run_dir(workload: str) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = workload.replace(":", "-").replace("/", "-").replace(".", "-")
    return Path("runs") / f"{safe}-{stamp}"


class Trainer:
    """Owns one run: set-up, the step loop, evaluation, checkpoints and telemetry."""

    def __init__(self, workload: Workload, config: TrainConfig,
                 progress: ProgressDisplay | None = None) -> None:
        config.validate()
        if config.max_steps is None and not is_sized(workload.train_dataset):
            raise UserError(
                f"Workload {workload.name!r}: the train dataset is a stream without a length "
                "(an endless or unsized IterableDataset), so a run has no epochs to count: "
                "give --max-steps N.")
        self.workload, self.config = workload, config
        seed_everything(config.seed)
        device = resolve_device(config.device)
        self.dist = init_distributed(device.type == "cuda",
                                     force=config.strategy in ("ddp", "fsdp", "tp", "pp"))
        if device.type == "cuda" and self.dist.world_size > 1:
            device = torch.device("cuda", self.dist.local_rank)
        self.device = device
        self.world = self.dist.world_size
        self.plan: Plan | None = None
        if config.strategy == "auto":
            from gpuflow.train.auto import plan_strategy

            config, self.plan = plan_strategy(workload, config, self.world)
            self.config = config
        self.strategy = config.resolved_strategy(self.world)
        self.dp, self.tp, self.pp = config.mesh_shape(self.world)
        self.mesh = self._device_mesh()
        self.dp_rank = self.mesh["dp"].get_local_rank() if self.mesh else self.dist.rank
        self.is_main = self.dist.is_main
        self.policy = make_policy(config.precision, self.device)
        if self.policy.loss_scaling and (self.strategy == "fsdp" or self.pp > 1):
            raise UserError(f"--strategy {self.strategy} supports fp32, tf32 and bf16; "
                            "use --precision bf16.")
        config = self.config = self._check_step_modes(config)
        self.run_dir = Path(config.run_dir) if config.run_dir else default_run_dir(workload.name)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.model = workload.model.to(self.device)
        self.model.train()
        # Counted whole, before any strategy shards or splits the model.
        self.trainable_params = sum(p.numel() for p in self.model.parameters()
                                    if p.requires_grad)
        example = move_to_device(workload.get_example_batch(), self.device)
        self.batch_probe: BatchProbe | None = None
        if config.batch_size == "auto":
            from gpuflow.train.auto import probe_batch_size

            self.batch_probe = probe_batch_size(
                self.model, example, self._probe_step, config, self.strategy, self.dp,
                self.device, agree=self._all_agree if self.world > 1 else None)
            config = dataclasses.replace(config, batch_size=self.batch_probe.micro_batch,
                                         grad_accum=self.batch_probe.grad_accum)
            self.config = config
        global_batch = config.batch_size * config.grad_accum * self.dp
        if config.global_batch is not None and config.global_batch != global_batch:
            raise UserError(
                f"--global-batch {config.global_batch} is not --batch-size {config.batch_size} "
                f"x --grad-accum {config.grad_accum} x {self.dp} data-parallel ranks "
                f"({global_batch}); drop one, or use --batch-size auto."
            )
        self.microbatches = self._pipeline_microbatches()

        self.micro_batch = config.batch_size
        # None for a stream without a length: it has no epochs.
        self.per_epoch_batches = (batches_per_epoch(workload.train_dataset, config.batch_size,
                                                    self.dp)
                                  if is_sized(workload.train_dataset) else None)
        self.eval_set = (eval_set(workload.val_dataset, config.batch_size, config.eval_batches)
                         if workload.val_dataset is not None else None)
        self.eval_time_s = 0.0
        if config.max_steps is not None:
            self.total_steps = config.max_steps
        else:
            assert self.per_epoch_batches is not None
            epochs = config.epochs if config.epochs is not None else DEFAULT_EPOCHS
            steps_per_epoch = max(1, self.per_epoch_batches // config.grad_accum)
            self.total_steps = max(1, math.ceil(epochs * steps_per_epoch))

        self.flops_per_step = self._count_step_flops(example) * self.dp
        # Converted after counting: the model's FLOPs are the same in fp8.
        self.fp8 = (fp8.convert(self.model, workload.blocks(), config.fp8_recipe,
                                fsdp_all_gather=self.strategy == "fsdp")
                    if config.precision == "fp8" else None)
        self.timer = StepTimer(self.device)
        self.pipeline: Pipeline | None = None
        self.forward_model: nn.Module = self._parallelize(example)
        self._collective_waits: contextlib.AbstractContextManager[Any] = (
            timed_waits.TimedWaits(self._waits, self.timer.exposed_comm) if self._waits
            else contextlib.nullcontext())
        self.compiled = False
        self.compile_scope: str | None = None
        if config.compile:
            self._compile(example)

        self.optimizer = build_optimizer(self.model, config, self.device)
        self.scheduler = build_scheduler(self.optimizer, config, self.total_steps)
        self.scaler = self.policy.make_scaler()
        if self.fp8 is not None and self.fp8.fsdp_float8_all_gather:
            fp8.precompute_scales_after_step(self.optimizer, self.model)
        self.peak = peak_flops(self.device, self.policy.peak_key)

        self.step = 0
        self.batches_consumed = 0
        self.skipped_steps = 0
        self.nonfinite_streak = 0
        self.samples_seen = 0
        self.last_checkpoint: ckpt.Checkpoint | None = None
        self._stream: StreamBatches | None = None
        self._stream_start: StreamPosition | None = None  # a stream's saved position
        resumed = self._maybe_resume()

        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._write_config()
        self.metrics = MetricsLog(
            self.run_dir / "metrics.jsonl",
            self.run_dir / "tensorboard" if config.tensorboard else None,
            enabled=self.is_main,
        )
        self.metrics.open(keep_until_step=self.step if resumed else None)
        self.progress = progress or ProgressDisplay(self.total_steps, self.step,
                                                    enabled=config.progress and self.is_main)
        self._batches: DevicePrefetcher | None = None
        self._started = time.perf_counter()
        self.timer.start_window()

    # --- set-up -------------------------------------------------------------------------

    def _check_step_modes(self, config: TrainConfig) -> TrainConfig:
        """Refuse fp8 and CUDA graphs where they cannot run (the device last, so that the
        other refusals show on a CPU too); both need --compile, which they turn on."""
        config.check_step_modes(self.strategy, self.tp, self.pp)
        if config.precision == "fp8":
            fp8.check_device(self.device)
        if config.cuda_graphs:
            cuda_graphs.check_static_shapes(self.workload.train_dataset, self.workload.collate,
                                            self.workload.name)
            cuda_graphs.check_device(self.device)
        wanted = [flag for flag, on in (("--precision fp8", config.precision == "fp8"),
                                        ("--cuda-graphs", config.cuda_graphs)) if on]
        if not wanted or config.compile:
            return config
        one = len(wanted) == 1
        warnings.warn(f"{' and '.join(wanted)} turn{'s' * one} on --compile, which "
                      f"{'it needs' if one else 'they need'}.", stacklevel=3)
        return dataclasses.replace(config, compile=True)

    def _probe_step(self, batch: Batch) -> None:
        """Forward and backward of one batch, leaving no trace (for --batch-size auto)."""
        inputs, target = batch
        with side_effect_free(self.model, self.device):
            with self.policy.autocast():
                loss = self.workload.loss_fn(call_model(self.model, inputs), target)
            loss.backward()

    def _all_agree(self, value: int) -> int:
        """The smallest of every rank's ``value``: all ranks act on the same verdict."""
        tensor = torch.tensor(value, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def _count_step_flops(self, example: Batch) -> int:
        """FLOPs of one forward+backward on the example batch, scaled to the step's batch.

        Counted on fake tensors, which cost no memory or time on the device; a model that
        fake tensors cannot run is counted on a real (side-effect-free) step instead.
        """
        inputs, target = example
        try:
            flops = count_training_flops(self.model, inputs, target, self.workload.loss_fn,
                                         self.policy.autocast())
        except Exception:
            flops = self._count_real_step_flops(inputs, target)
        per_sample = flops / batch_size_of(example)
        return round(per_sample * self.micro_batch * self.config.grad_accum)

    def _count_real_step_flops(self, inputs: Any, target: torch.Tensor) -> int:
        def probe() -> None:
            with self.policy.autocast():
                loss = self.workload.loss_fn(call_model(self.model, inputs), target)
            loss.backward()

        try:
            with side_effect_free(self.model, self.device):
                return count_flops(probe)
        except Exception as exc:
            raise UserError(
                f"Workload {self.workload.name!r}: the model failed on a batch from its train "
                f"dataset ({type(exc).__name__}: {exc}). Check that the dataset yields "
                "(inputs, target) pairs whose shapes and dtypes the model and loss accept."
            ) from exc

    def _device_mesh(self) -> DeviceMesh | None:
        """(dp, tp) with tensor parallelism innermost, or (pp, dp) with pipeline stages
        outermost, as torchtitan lays them out; None for data parallelism alone."""
        if self.tp > 1:
            return init_device_mesh(self.device.type, (self.dp, self.tp),
                                    mesh_dim_names=("dp", "tp"))
        if self.pp > 1:
            return init_device_mesh(self.device.type, (self.pp, self.dp),
                                    mesh_dim_names=("pp", "dp"))
        return None

    def _pipeline_microbatches(self) -> int:
        if self.pp == 1:
            return 1
        config = self.config
        count = config.microbatches or 2 * self.pp
        if config.batch_size % count:
            raise UserError(
                f"--batch-size {config.batch_size} does not split into --microbatches {count}; "
                "pick a batch size that is a multiple of it."
            )
        if count < self.pp * stages_per_rank(config.pp_schedule) and \
                config.pp_schedule != "gpipe":
            raise UserError(
                f"--pp-schedule {config.pp_schedule} needs at least as many micro-batches as "
                f"pipeline stages ({self.pp * stages_per_rank(config.pp_schedule)}); "
                f"got --microbatches {count}."
            )
        if config.compile:
            raise UserError("--compile is not supported with pipeline parallelism yet; "
                            "drop --compile or use fsdp/tp.")
        return count

    def _parallelize(self, example: Batch) -> nn.Module:
        """Apply the plan in PyTorch's order: PP split, TP, activation checkpointing, then
        DDP or FSDP. Returns the module the step calls."""
        if self.pp > 1:
            return self._pipeline(example)
        if self.mesh is not None:
            # Imports DTensor.
            from gpuflow.parallel.tensor import apply_tensor_parallel

            apply_tensor_parallel(self.workload.blocks(), self.workload.parallel_plan(self.tp),
                                  self.mesh["tp"])
        if self.config.activation_checkpointing:
            apply_activation_checkpointing(self.model, self.workload.blocks())
        if self.strategy == "ddp":
            return apply_ddp(self.model, self.device, on_bucket_ready=self.timer.comm.begin,
                             bucket_mb=self.config.bucket_mb)
        if self.strategy == "fsdp":
            param_dtype = self.policy.autocast_dtype
            apply_fsdp(self.model, self.workload.blocks(), param_dtype,
                       self.config.reshard_after_forward,
                       mesh=self.mesh["dp"] if self.mesh is not None else None,
                       blocking_comm=self._host_collective_timer, wrap=self.config.fsdp_wrap,
                       prefetch=self.config.fsdp_prefetch)
        return self.model

    def _pipeline(self, example: Batch) -> nn.Module:
        """Split the model into stages; this rank keeps its own, under FSDP when asked."""
        from gpuflow.parallel.pipeline import Pipeline  # torch's pipelining: ~30 MB to import

        assert self.mesh is not None
        inputs = resize_rows(example[0], self.config.batch_size // self.microbatches)
        self.pipeline = Pipeline(self.model, self.workload.blocks(), inputs, self.mesh["pp"],
                                 self.config.pp_schedule, self.microbatches,
                                 self._policy_loss, self.device, split=self.config.pp_split)
        self.model = self.pipeline.parts
        stages = self.pipeline.stages
        if self.config.activation_checkpointing:
            apply_activation_checkpointing(
                self.model, [block for stage in stages for block in self.pipeline.blocks_of(stage)])
        if self.strategy == "fsdp":
            for stage in stages:
                apply_fsdp(stage.submod, self.pipeline.blocks_of(stage),
                           self.policy.autocast_dtype, self.config.reshard_after_forward,
                           mesh=self.mesh["dp"], blocking_comm=self._host_collective_timer,
                           wrap=self.config.fsdp_wrap, prefetch=self.config.fsdp_prefetch)
            self.pipeline.grad_shards = (self.dp, self.dp_rank)
        return self.model

    def _policy_loss(self, outputs: Any, target: torch.Tensor) -> torch.Tensor:
        return self.workload.loss_fn(outputs, target)

    def _compile(self, example: Batch) -> None:
        """Compile each repeated block in place where the model has them, else the model;
        under --cuda-graphs the whole model, into one graph per step direction.

        Identical blocks share one compiled graph (PyTorch's regional compilation), so cold
        compile time does not grow with depth and parameter names stay unchanged. A trial
        step at the micro-batch's shape surfaces compiler failures here (the run then continues
        in eager mode, or stops under --cuda-graphs, which asked for graphs) and compiles the
        graph the steps will use.
        """
        blocks = [] if self.config.cuda_graphs else self.workload.blocks()
        inputs, target = resize_rows(example, self.micro_batch)
        try:
            if self.config.cuda_graphs:
                compiled = cuda_graphs.graph(self.forward_model)
            elif blocks:
                for block in blocks:
                    block.compile()
                compiled = self.forward_model
            else:
                compiled = torch.compile(self.forward_model)
            with side_effect_free(self.model, self.device):
                with self.policy.autocast():
                    loss = self.workload.loss_fn(call_model(compiled, inputs), target)
                loss.backward()
        except Exception as exc:
            if self.config.cuda_graphs:
                raise UserError(f"--cuda-graphs: torch.compile failed to record the step "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0]}); drop "
                                "--cuda-graphs to train without graphs.") from exc
            for block in blocks:
                block._compiled_call_impl = None  # undoes nn.Module.compile()
            warnings.warn(
                f"torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                "training continues in eager mode.", stacklevel=2,
            )
            return
        self.forward_model, self.compiled = compiled, True
        self.compile_scope = (f"{len(blocks)} blocks" if blocks else
                              "model, as CUDA graphs" if self.config.cuda_graphs else "model")

    def _maybe_resume(self) -> bool:
        if not self.config.resume:
            return False
        # Rank 0 verifies the checksums once and tells the others which checkpoint to read.
        choice = [ckpt.latest_verified(self.checkpoint_dir) if self.is_main else None]
        if self.world > 1:
            dist.broadcast_object_list(choice, src=0)
        checkpoint = choice[0]
        if checkpoint is None:
            raise UserError(
                f"--resume: no valid checkpoint in {self.checkpoint_dir}. Check the run dir, "
                "or start without --resume."
            )
        state = ckpt.load_trainer_state(checkpoint)
        from gpuflow.train import model_state  # torch's state-dict helpers: ~50 MB to import

        try:
            if ckpt.is_sharded(checkpoint):
                model_state.load_sharded(self.model, self.optimizer, self.pipeline,
                                         checkpoint.path / ckpt.STATE_DIR,
                                         state["optimizer"]["param_groups"])
            else:
                weights, state = ckpt.load_checkpoint(checkpoint)
                model_state.load_full(self.model, self.optimizer, self.pipeline, weights,
                                      state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise UserError(
                f"--resume: the state in {checkpoint.path} does not fit this workload's model "
                f"({str(exc).splitlines()[0]}). Resume with the workload that wrote it."
            ) from None
        restore_schedule(self.scheduler, state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        ckpt.restore_rng_state(state["rng"])
        self.step = state["step"]
        self.batches_consumed = state["batches_consumed"]
        positions = state.get("data_stream")
        if positions is not None and len(positions) == self.world:
            self._stream_start = StreamPosition(**positions[self.dist.rank])
        self.skipped_steps = state["skipped_steps"]
        self.samples_seen = state["samples_seen"]
        self.last_checkpoint = checkpoint
        return True

    def _write_config(self) -> None:
        (self.run_dir / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))

    # --- the loop -----------------------------------------------------------------------

    def _batch_stream(self) -> DevicePrefetcher:
        if self._batches is None:
            config = self.config
            source = train_batches(
                self.workload.train_dataset, config.batch_size, self.workload.collate,
                seed=config.seed, start_batch=self.batches_consumed,
                stream_start=self._stream_start,
                num_workers=config.num_workers, pin_memory=self.device.type == "cuda",
                rank=self.dp_rank, world_size=self.dp,
                batched_indexing=supports_batched_indexing(self.workload.train_dataset,
                                                           self.workload.collate_fn,
                                                           self.workload.augment),
                augment=self.workload.augment,
            )
            self._stream = source if isinstance(source, StreamBatches) else None
            self._batches = DevicePrefetcher(source, self.device,
                                             background=config.num_workers == 0)
        return self._batches

    def _grad_sync(self, micro_step: int) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient all-reduce on all but the last micro-step, where the model allows."""
        last = micro_step == self.config.grad_accum - 1
        if set_gradient_sync(self.model, last):
            return contextlib.nullcontext()
        no_sync = getattr(self.forward_model, "no_sync", None)
        return contextlib.nullcontext() if last or no_sync is None else no_sync()

    def train_step(self) -> float:
        """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss."""
        config, timer, batches = self.config, self.timer, self._batch_stream()
        accum = config.grad_accum
        losses = []
        for micro in range(accum):
            timer.wait_begin()
            inputs, target = next(batches)
            timer.wait_end()
            timer.compute.begin()
            if self.pipeline is not None:
                with self._collective_waits, self.policy.autocast():
                    loss = self.pipeline.forward_backward(inputs, target, 1 / accum)
            else:
                with self._grad_sync(micro), self._collective_waits:
                    with self.policy.autocast():
                        loss = self.workload.loss_fn(call_model(self.forward_model, inputs),
                                                     target)
                    scaled = loss / accum if accum > 1 else loss
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            timer.comm.end_if_begun()
            timer.compute.end()
            losses.append(loss.detach())
        self.batches_consumed += accum
        timer.optimizer.begin()
        if self.pipeline is not None:
            self.pipeline.sync_tied_grads()
        loss = losses[0] if accum == 1 else torch.stack(losses).mean()
        if self.world > 1:
            # Every rank must agree on skipping a non-finite step, and logs the global mean
            # (under pipelining only last stages hold a loss; the others add zeros).
            loss = loss.clone()
            dist.all_reduce(loss)
            loss /= self.world // self.pp
        loss_value = loss.item()
        self._optimizer_step(math.isfinite(loss_value))
        timer.optimizer.end()
        self.step += 1
        step_samples = self.micro_batch * accum * self.dp
        self.samples_seen += step_samples
        window = timer.window
        window.steps += 1
        window.samples += step_samples
        window.loss_sum += loss_value
        return loss_value

    def _optimizer_step(self, finite: bool) -> None:
        """Update unless the loss or (under fp16) the gradients overflowed; count skips."""
        stepped = finite
        if not finite:
            self.skipped_steps += 1
            self.nonfinite_streak += 1
        else:
            self.nonfinite_streak = 0
            if self.scaler is not None:
                if self.config.clip_grad:
                    self.scaler.unscale_(self.optimizer)
                    self._clip_gradients(self.config.clip_grad)
                scale = self.scaler.get_scale()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                stepped = self.scaler.get_scale() >= scale
                self.skipped_steps += not stepped
            else:
                if self.config.clip_grad:
                    self._clip_gradients(self.config.clip_grad)
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if stepped:
            self.scheduler.step()
            return
        with warnings.catch_warnings():
            # The schedule still advances on a skipped step; torch warns about that order.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
            self.scheduler.step()

    def _clip_gradients(self, max_norm: float) -> None:
        if self.pipeline is not None:
            self.pipeline.clip_grad_norm(max_norm)
        else:
            nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def run_steps(self, count: int) -> None:
        """Run up to ``count`` steps with everything a step entails: logging, evaluation
        and checkpoints on their schedules, and the non-finite-loss stop."""
        config = self.config
        for _ in range(min(count, self.total_steps - self.step)):
            self.train_step()
            if self.nonfinite_streak >= config.max_nonfinite_steps:
                self._stop_nonfinite()
            at_end = self.step == self.total_steps
            if self.step % config.log_every == 0 or at_end:
                self._log_window()
            if config.eval_every and self.step % config.eval_every == 0 and not at_end:
                self.evaluate()
            if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                self.save_checkpoint()

    def fit(self) -> RunResult:
        """Train to ``total_steps``, evaluate, save the final checkpoint and the summary."""
        if self.is_main:
            self.progress.announce(self._banner())
        try:
            self.run_steps(self.total_steps - self.step)
            final = self.evaluate()
            if self.config.save_checkpoints and (self.last_checkpoint is None
                                                 or self.last_checkpoint.step != self.step):
                self.save_checkpoint()
        finally:
            self.close()
        summary = self._write_summary(final)
        return RunResult(self.run_dir, self.step, final, summary, self.model)

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None
        self.progress.close()
        self.metrics.close()

    def _stop_nonfinite(self) -> None:
        first = self.step - self.nonfinite_streak + 1
        where = (f"the last good checkpoint is {self.last_checkpoint.path}"
                 if self.last_checkpoint else "no checkpoint was saved before it")
        raise NonFiniteLossError(
            f"The loss was NaN/inf for {self.nonfinite_streak} consecutive steps "
            f"({first}-{self.step}); training stopped and {where}. Try a lower --lr, "
            "--clip-grad 1.0, a longer --warmup-steps, or --precision bf16 instead of fp16."
        )

    def _banner(self) -> str:
        config = self.config
        resumed = f", resumed at step {self.step}" if self.step else ""
        if self.step and is_stream(self.workload.train_dataset):
            resumed += f" ({self._resume_note()})"
        compiled = f", compiled ({self.compile_scope})" if self.compiled else ""
        pipeline = (f" x pp {self.pp} ({config.pp_schedule}, {self.microbatches} "
                    f"micro-batches{', manual stages' if self.pipeline.manual else ''})"
                    if self.pipeline is not None else "")
        strategy = self.strategy
        if strategy == "fsdp" and config.fsdp_wrap == "model":
            strategy += " as one unit"
        elif strategy == "fsdp" and config.fsdp_prefetch:
            strategy += f", prefetch depth {config.fsdp_prefetch}"
        ranks = (f" x {self.world} ranks ({strategy}, dp {self.dp} x tp {self.tp}"
                 f"{pipeline})" if self.world > 1 else "")
        global_batch = self.micro_batch * config.grad_accum * self.dp
        chosen = ""
        if self.plan is not None:
            chosen += (f"; --strategy auto chose {self.strategy} (dp {self.dp} x tp {self.tp} x "
                       f"pp {self.pp}), predicted {self.plan.predicted_peak_bytes / 2**30:.2f} "
                       f"GiB and {self.plan.predicted_step_s * 1e3:.1f} ms per step")
        if self.batch_probe is not None:
            chosen += (f"; --batch-size auto: {self.batch_probe.largest_fitting} fit, running "
                       f"{self.micro_batch} x accum {config.grad_accum}")
        return (
            f"gpuflow: {self.workload.name} on {device_name(self.device)} ({self.device}){ranks}, "
            f"{self.policy.describe()}, global batch {global_batch} = micro-batch "
            f"{self.micro_batch} x accum {config.grad_accum} x data-parallel {self.dp}, "
            f"{self.fp8.describe() + '; ' if self.fp8 else ''}"
            f"{self.total_steps} steps{resumed}{compiled}; {self._eval_plan()}; "
            f"run dir {self.run_dir}{chosen}"
        )

    def _eval_plan(self) -> str:
        if self.eval_set is None:
            return "no validation set"
        every = self.config.eval_every
        when = f"every {every} steps and at the end" if every else "at the end"
        return f"evaluates {self.eval_set.describe()} {when}"

    def _log_window(self) -> None:
        window = self.timer.close_window()
        achieved = self.flops_per_step / window["step_time_s"] if window["step_time_s"] else 0.0
        peak_mem, _ = peak_memory_bytes(self.device)
        tokens = self.workload.tokens_per_sample
        record = {
            "step": self.step,
            "epoch": (self.batches_consumed / self.per_epoch_batches
                      if self.per_epoch_batches else None),
            "loss": window["loss"],
            "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_s": window["samples_per_s"],
            "tokens_per_s": window["samples_per_s"] * tokens if tokens else None,
            "step_time_s": window["step_time_s"],
            "data_wait_s": window["data_wait_s"],
            "compute_s": window["compute_s"],
            "optimizer_s": window["optimizer_s"],
            "comm_s": window["comm_s"] if self._comm_measured else None,
            "host_s": window["host_s"],
            "data_wait_frac": window["data_wait_frac"],
            "comm_frac": window["comm_frac"] if self._comm_measured else None,
            "flops_per_step": self.flops_per_step,
            "achieved_flops": achieved,
            "mfu": achieved / (self.peak.flops * self.world) if self.peak.flops else None,
            "peak_mem_bytes": peak_mem,
            "skipped_steps": self.skipped_steps,
            "world_size": self.world,
            "window_steps": window["window_steps"],
            "elapsed_s": time.perf_counter() - self._started,
        }
        self.metrics.write(record)
        self.progress.update(self.step, record)

    @property
    def _host_collective_timer(self) -> Callable[[], contextlib.AbstractContextManager[None]
                                                  ] | None:
        """On the CPU FSDP's collectives hold the host, so timing them there measures them;
        beside untimed collectives they are not timed either, so that the step's breakdown
        still adds up."""
        if self.device.type != "cpu":
            return None
        return self.timer.exposed_comm if self._comm_measured else contextlib.nullcontext

    @functools.cached_property
    def _waits(self) -> list[timed_waits.Wait] | None:
        """The functions in which this run waits for collectives whose waiting is not timed
        otherwise (``gpuflow.parallel.timed_waits``); None where one of them cannot be timed:
        it is not there, or compiled code waits inside its graph (tensor parallelism under
        --compile), or the device is neither the CPU nor CUDA."""
        waits: list[timed_waits.Wait] = []
        if self.tp > 1:
            if self.config.compile:
                return None
            waits += timed_waits.functional_collective_waits()
        if self.pp > 1:
            waits += timed_waits.pipeline_waits()
        if self.strategy == "fsdp" and self.device.type != "cpu":
            waits += timed_waits.fsdp_waits()
        if waits and self.device.type not in ("cpu", "cuda"):
            return None
        return waits if timed_waits.timeable(waits) else None

    @property
    def _comm_measured(self) -> bool:
        """Exposed communication is measured for DDP (from its last bucket, nil for one
        process), for FSDP's collectives on the CPU (``gpuflow.parallel.host_collectives``)
        and wherever else a run's waits for collectives can be timed (``_waits``)."""
        return self.strategy in ("single", "ddp") or self._waits is not None

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and the workload's metrics over the validation set, sample-weighted.

        Every rank evaluates the whole set (FSDP needs all ranks in each forward), so each
        holds the same result; under pipelining the last stage computes it and hands it on.
        """
        if self.eval_set is None:
            return {}
        started = time.perf_counter()
        self.model.eval()
        loader = self.eval_set.loader(self.workload.collate, self.config.num_workers,
                                      self.device.type == "cuda")
        totals: dict[str, float] = {}
        count = 0
        for batch in loader:
            inputs, target = move_to_device(batch, self.device, non_blocking=True)
            size = batch_size_of((inputs, target))
            with self.policy.autocast():
                outputs = self._eval_outputs(inputs, target)
                if outputs is None:
                    continue
                values = {"loss": self.workload.loss_fn(outputs, target)}
                values.update({name: fn(outputs, target)
                               for name, fn in self.workload.metrics.items()})
            for name, value in values.items():
                totals[name] = totals.get(name, 0.0) + float(value) * size
            count += size
        self.model.train()
        result = {f"val_{name}": total / count for name, total in totals.items()}
        if self.pipeline is not None:
            result = self.pipeline.broadcast_from_last(result)
        seconds = time.perf_counter() - started
        self.eval_time_s += seconds
        self.metrics.write({"event": "eval", "step": self.step, "eval_s": seconds, **result})
        self.progress.message(
            f"eval @ step {self.step}: "
            + ", ".join(f"{name} {value:.4f}" for name, value in result.items())
        )
        return result

    def _eval_outputs(self, inputs: Any, target: torch.Tensor) -> Any:
        """The model's outputs for one batch; None on pipeline stages that hold none.

        A pipeline runs full batches only: a short last batch is padded and the padding's
        outputs dropped.
        """
        if self.pipeline is None:
            return call_model(self.model, inputs)
        size = int(target.shape[0])
        full = self.config.batch_size
        outputs = self.pipeline.forward(resize_rows(inputs, full), resize_rows(target, full))
        return None if outputs is None else resize_rows(outputs, size)

    def trainer_state(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": self.step,
            "batches_consumed": self.batches_consumed,
            "skipped_steps": self.skipped_steps,
            "samples_seen": self.samples_seen,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": ckpt.capture_rng_state(),
            "data_stream": self._stream_positions(),
        }

    def _stream_positions(self) -> list[dict[str, Any]] | None:
        """Every rank's position in its train stream after the batches trained on, by
        global rank (a collective when distributed); None where a stream cannot say."""
        if not is_stream(self.workload.train_dataset):
            return None
        mine = (self._stream.position_after(self.batches_consumed) if self._stream is not None
                else self._stream_start)
        positions = [mine.as_dict() if mine is not None else None]
        if self.world > 1:
            positions = [None] * self.world
            dist.all_gather_object(positions, mine.as_dict() if mine is not None else None)
        return None if any(p is None for p in positions) else positions

    def _resume_note(self) -> str:
        return resume_note(self.workload.train_dataset, self._stream_start is not None
                           and self.config.num_workers == 0)

    def save_checkpoint(self) -> ckpt.Checkpoint:
        """One process writes the full state; in a distributed job every rank writes its
        own shards in parallel (a collective), with nothing gathered."""
        from gpuflow.train import model_state  # torch's state-dict helpers: ~50 MB to import

        keep = self.config.keep_checkpoints
        if self.world == 1:
            weights, optimizer_state = model_state.full_state(self.model, self.optimizer)
            self.last_checkpoint = ckpt.save_checkpoint(
                self.checkpoint_dir, self.step, weights, self.trainer_state(optimizer_state),
                keep)
            return self.last_checkpoint
        weights, optimizer_state = model_state.local_state(self.model, self.optimizer,
                                                           self.pipeline)
        # The shards hold the optimizer's tensors; its hyperparameters go with the trainer.
        trainer_state = self.trainer_state({"param_groups": optimizer_state["param_groups"]})
        self.last_checkpoint = ckpt.save_sharded_checkpoint(
            self.checkpoint_dir, self.step,
            {"model": weights, "optimizer": optimizer_state["state"]}, trainer_state, keep,
            is_main=self.is_main, barrier=dist.barrier)
        return self.last_checkpoint

    def _plan_record(self, peak_mem: int | None) -> dict[str, Any] | None:
        """What --strategy auto and --batch-size auto chose, predicted next to measured."""
        if self.plan is None and self.batch_probe is None:
            return None
        record: dict[str, Any] = {
            "strategy_auto": self.plan.as_dict() if self.plan else None,
            "batch_size_auto": self.batch_probe.as_dict() if self.batch_probe else None,
        }
        if self.plan is not None:
            measured_step = medians(self.metrics.step_records()).get("step_time_s")
            # The planner predicts tensor memory: a CPU process's RSS, which also holds the
            # interpreter and its libraries, is no measurement of that.
            tensors = peak_mem if self.device.type == "cuda" else None
            record["predicted_vs_measured"] = {
                "peak_mem_bytes": [self.plan.predicted_peak_bytes, tensors],
                "step_time_s": [self.plan.predicted_step_s, measured_step],
            }
        return record

    def _write_summary(self, final: dict[str, float]) -> dict[str, Any]:
        peak_mem, mem_kind = peak_memory_bytes(self.device)
        global_batch = self.micro_batch * self.config.grad_accum * self.dp
        summary = {
            "format_version": RUN_FORMAT_VERSION,
            "workload": self.workload.name,
            "steps": self.step,
            "samples_seen": self.samples_seen,
            "skipped_steps": self.skipped_steps,
            "wall_time_s": time.perf_counter() - self._started,
            "eval_time_s": self.eval_time_s,
            "evaluated": self.eval_set.describe() if self.eval_set is not None else None,
            "final_metrics": final,
            "median": medians(self.metrics.step_records()),
            "precision": self.config.precision,
            "precision_description": self.policy.describe(),
            "compiled": self.compiled,
            "compile_scope": self.compile_scope,
            "fp8": self.fp8.as_dict() if self.fp8 else None,
            "activation_checkpointing": self.config.activation_checkpointing,
            "device": str(self.device),
            "device_name": device_name(self.device),
            "flops_per_step": self.flops_per_step,
            "trainable_params": self.trainable_params,
            "peak_flops": self.peak.flops,
            "peak_flops_source": self.peak.source,
            "peak_mem_bytes": peak_mem,
            "peak_mem_kind": mem_kind,
            "device_memory_bytes": device_memory_bytes(self.device),
            "native_bf16": native_bf16(self.device),
            "global_batch": global_batch,
            "strategy": self.strategy,
            "world_size": self.world,
            "mesh": {"dp": self.dp, "tp": self.tp, "pp": self.pp},
            "versions": {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "python": platform.python_version(),
            },
            "plan": self._plan_record(peak_mem),
            "checkpoint": str(self.last_checkpoint.path) if self.last_checkpoint else None,
            "run_dir": str(self.run_dir),
            "config": self.config.to_dict(),
        }
        if self.is_main:
            tmp = self.run_dir / "summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2))
            tmp.replace(self.run_dir / "summary.json")
        return summary


def train(workload: Workload, config: TrainConfig | None = None,
          progress: ProgressDisplay | None = None) -> RunResult:
    """Train ``workload`` as ``config`` says; the Python API behind `gpuflow train`."""
    return Trainer(workload, config or TrainConfig(), progress).fit()
