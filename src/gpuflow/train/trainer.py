"""The training loop: set-up in a fixed order, the step, evaluation and the run's schedule.

What differs between parallel layouts lives in the run's :class:`~gpuflow.parallel.strategy.
Strategy`; what a run saves, in :mod:`gpuflow.train.state`; what it reports, in
:mod:`gpuflow.train.record`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpuflow import lora
from gpuflow.config import TrainConfig
from gpuflow.data.eval_set import eval_set
from gpuflow.data.iterable import StreamBatches, is_sized, is_stream, resume_note
from gpuflow.data.loader import (
    BatchPlan,
    batches_per_epoch,
    supports_batched_indexing,
    train_batches,
)
from gpuflow.data.prefetch import DevicePrefetcher, move_to_device
from gpuflow.devices import peak_flops, resolve_device
from gpuflow.errors import UserError
from gpuflow.parallel import build_strategy
from gpuflow.parallel.dims import ParallelDims
from gpuflow.parallel.env import init_distributed
from gpuflow.parallel.strategy import ModelParts, resize_rows
from gpuflow.precision import autocast_dtype, make_policy
from gpuflow.telemetry.steps import MetricsLog, StepTimer, medians
from gpuflow.train import chunked_loss, fp8, record
from gpuflow.train.averaging import WeightAverage
from gpuflow.train.batch import fit_batch
from gpuflow.train.compile import Compiled, compile_step, turn_on_compile_for_step_modes
from gpuflow.train.data_report import all_ranks_report
from gpuflow.train.evaluate import evaluate
from gpuflow.train.optim import build_optimizer, build_scheduler, optimizer_step
from gpuflow.train.preemption import Preemption
from gpuflow.train.probe import step_flops
from gpuflow.train.progress import ProgressDisplay
from gpuflow.train.state import Position, RunState, seed_everything
from gpuflow.train.units import StepCounter
from gpuflow.workload import Batch, Workload, call_model, serving_state

if TYPE_CHECKING:
    from gpuflow.planner.search import Plan

DEFAULT_EPOCHS = 10.0


@dataclass
class RunResult:
    """What `train()` hands back: where the run lives and how it ended."""

    run_dir: Path
    steps: int
    final_metrics: dict[str, float]
    summary: dict[str, Any]
    model: nn.Module


class Trainer:
    """Owns one run: set-up, the step loop, evaluation, checkpoints and telemetry."""

    def __init__(self, workload: Workload, config: TrainConfig,
                 progress: ProgressDisplay | None = None) -> None:
        config.validate()
        if config.max_steps is None and not is_sized(workload.train_dataset):
            raise UserError(f"Workload {workload.name!r}: the train dataset is a stream "
                            "without a length (an endless or unsized IterableDataset), so a "
                            "run has no epochs to count: give --max-steps N.")
        self.workload = workload
        seed_everything(config.seed)
        self.lora = lora.LoraSpec.of(vars(config))
        # Adapters before the planner (--strategy auto), which counts them and the frozen base.
        self.model = lora.wrap(workload.model, self.lora, autocast_dtype(config.precision))
        config = self._join_processes(config)
        config = self._planned_batch_size(config)
        self.policy = make_policy(config.precision, self.device)
        config = turn_on_compile_for_step_modes(config, self.dims, self.device, workload)
        self.workload = workload = chunked_loss.switch(workload, config, self.dims)
        # The timer before the strategy: DDP's bucket hook reports to it.
        self.timer = StepTimer(self.device)
        self.strategy = build_strategy(self.dims, self.device, self.policy, self.timer,
                                       compile=config.compile)
        self.run_dir = record.run_dir(config.run_dir, workload.name)
        self.model = self.model.to(self.device).train()
        # Counted whole, before any strategy shards or splits the model.
        self.trainable_params = sum(p.numel() for p in self.model.parameters()
                                    if p.requires_grad)
        example = move_to_device(workload.get_example_batch(), self.device)
        config, self.batch_probe = fit_batch(config, self.dims, self.model, example,
                                             workload.loss_fn, self.policy, self.device)
        self.config = config
        self.global_batch = self.dims.global_batch(config.batch_size, config.grad_accum)
        self.counter = StepCounter(workload, self.dims, self.device, self.global_batch,
                                   config.grad_accum)
        self._schedule_steps(config)
        self.flops_per_step = self._step_flops(example)
        # Converted after counting: the model's FLOPs are the same in fp8.
        self.fp8 = (fp8.convert(self.model, workload.blocks(), config.fp8_recipe,
                                fsdp_all_gather=self.dims.sharded,
                                min_features=config.fp8_min_features)
                    if config.precision == "fp8" else None)
        parts = ModelParts(workload.blocks, workload.loss_fn, workload.parallel_plan,
                           call_model, config.activation_checkpointing, self.lora is None)
        self.strategy.setup(self.model, parts, example[0], config.batch_size)
        self.model = self.strategy.model
        self.compiled: Compiled | None = self._compile(example) if config.compile else None
        self.optimizer = build_optimizer(self.model, config, self.device)
        self.scheduler = build_scheduler(self.optimizer, config, self.total_steps)
        self.scaler = self.policy.make_scaler()
        decay = workload.default_ema_decay if config.ema_decay is None else config.ema_decay
        self.average = WeightAverage(self.optimizer, decay) if decay else None
        if self.fp8 is not None and self.fp8.fsdp_float8_all_gather:
            fp8.precompute_scales_after_step(self.optimizer, self.model)
        self.peak = peak_flops(self.device, self.policy.peak_key)
        self.state = RunState(self.run_dir / "checkpoints", self.strategy, self.optimizer,
                              self.scheduler, self.scaler, config.keep_checkpoints)
        if config.resume:
            self.state.resume()
        self.preemption = Preemption(config.save_on_signal and config.save_checkpoints)
        self._open_records(progress, resumed=bool(config.resume))

    # --- set-up -------------------------------------------------------------------------

    def _join_processes(self, config: TrainConfig) -> TrainConfig:
        """Join the job, pick this process's device and its parallel layout (the planner's,
        under --strategy auto)."""
        device = resolve_device(config.device)
        self.dist = init_distributed(device.type == "cuda",
                                     force=config.strategy in ("ddp", "fsdp", "tp", "pp"))
        if device.type == "cuda" and self.dist.world_size > 1:
            device = torch.device("cuda", self.dist.local_rank)
        self.device, self.is_main = device, self.dist.is_main
        self.plan: Plan | None = None
        if config.strategy == "auto":
            from gpuflow.train.auto import plan_strategy

            config, self.plan = plan_strategy(self.workload, config, self.dist.world_size)
        self.dims = ParallelDims.from_config(config, self.dist.world_size)
        return config

    def _schedule_steps(self, config: TrainConfig) -> None:
        """Steps to run, batches per epoch and the evaluation set."""
        dataset = self.workload.train_dataset
        # None for a stream without a length: it has no epochs.
        plan = self._batch_plan(rank=0)
        self.per_epoch_batches = (
            plan.per_rank if plan is not None else
            batches_per_epoch(dataset, config.batch_size, self.dims.dp) if is_sized(dataset)
            else None)
        self.eval_set = (eval_set(self.workload.val_dataset, config.batch_size,
                                  config.eval_batches)
                         if self.workload.val_dataset is not None else None)
        self.eval_time_s = 0.0
        if config.max_steps is not None:
            self.total_steps = config.max_steps
            return
        assert self.per_epoch_batches is not None
        epochs = (config.epochs if config.epochs is not None
                  else self.workload.default_epochs or DEFAULT_EPOCHS)
        steps_per_epoch = max(1, self.per_epoch_batches // config.grad_accum)
        self.total_steps = max(1, math.ceil(epochs * steps_per_epoch))

    def _step_flops(self, example: Batch) -> int:
        """FLOPs of one optimizer step over all data-parallel replicas."""
        flops = step_flops(self.model, example, self.workload.loss_fn, self.policy,
                           self.device, self.workload.name)
        per_sample = flops / int(example[1].shape[0])
        return round(per_sample * self.config.batch_size * self.config.grad_accum) * self.dims.dp

    def _planned_batch_size(self, config: TrainConfig) -> TrainConfig:
        """A workload that forms its own batches sets the micro-batch to their mean size
        (rounded): what the banner, FLOPs per step and evaluation batches go by."""
        plan = self._batch_plan(rank=0, config=config)
        if plan is None:
            return config
        sizes = [len(batch) for batch in plan]
        return dataclasses.replace(config, batch_size=max(1, round(sum(sizes) / len(sizes))))

    def _batch_plan(self, rank: int, config: TrainConfig | None = None) -> BatchPlan | None:
        """The workload's own batches for data-parallel ``rank``, if it forms them."""
        sampler, seed = self.workload.batch_sampler, (config or self.config).seed
        return None if sampler is None else sampler(seed, rank, self.dims.dp)

    def _compile(self, example: Batch) -> Compiled | None:
        compiled = compile_step(self.strategy.forward_model, self.model, self.workload.blocks(),
                                resize_rows(example, self.config.batch_size),
                                self.workload.loss_fn, self.policy, self.device, self.config)
        if compiled is not None:
            self.strategy.forward_model = compiled.module
        return compiled

    def _open_records(self, progress: ProgressDisplay | None, resumed: bool) -> None:
        self.started = time.perf_counter()
        self.description = self._describe()
        record.write_run_files(self.description, serving_state(self.workload))
        self.metrics = MetricsLog(
            self.run_dir / "metrics.jsonl",
            self.run_dir / "tensorboard" if self.config.tensorboard else None,
            enabled=self.is_main)
        self.metrics.open(keep_until_step=self.position.step if resumed else None)
        self.progress = progress or ProgressDisplay(self.total_steps, self.position.step,
                                                    enabled=self.config.progress and self.is_main)
        self.nonfinite_streak = 0
        self._batches: DevicePrefetcher | None = None
        self._stream: StreamBatches | None = None
        self.timer.start_window()

    def _describe(self) -> record.RunDescription:
        """What the run's records say of it, fixed now that it is set up."""
        workload, step = self.workload, self.position.step
        exact = self.state.stream_start is not None and self.config.num_workers == 0
        return record.RunDescription(
            workload=workload.name, tokens_per_sample=workload.tokens_per_sample,
            device=self.device, dims=self.dims, layout=self.strategy.describe(),
            precision=self.policy.describe(), config=MappingProxyType(self.config.to_dict()),
            global_batch=self.global_batch, total_steps=self.total_steps, start_step=step,
            per_epoch_batches=self.per_epoch_batches, flops_per_step=self.flops_per_step,
            trainable_params=self.trainable_params, peak=self.peak,
            comm_measured=self.strategy.comm_measured, run_dir=self.run_dir,
            is_main=self.is_main, started=self.started,
            evaluated=self.eval_set.describe() if self.eval_set is not None else None,
            compiled=self.compiled, fp8=self.fp8,
            ema_decay=self.average.decay if self.average is not None else None,
            resume_note=(resume_note(workload.train_dataset, exact)
                         if step and is_stream(workload.train_dataset) else None),
            plan=self.plan, batch_probe=self.batch_probe)

    @property
    def position(self) -> Position:
        return self.state.position

    @property
    def step(self) -> int:
        return self.state.position.step

    # --- the loop -----------------------------------------------------------------------

    def _batch_stream(self) -> DevicePrefetcher:
        if self._batches is None:
            config, dataset = self.config, self.workload.train_dataset
            source = train_batches(
                dataset, config.batch_size, self.workload.collate,
                seed=config.seed, start_batch=self.position.batches_consumed,
                stream_start=self.state.stream_start,
                num_workers=config.num_workers, pin_memory=self.device.type == "cuda",
                rank=self.strategy.dp_rank, world_size=self.dims.dp,
                batched_indexing=supports_batched_indexing(dataset, self.workload.collate_fn,
                                                           self.workload.augment),
                augment=self.workload.augment,
                plan=self._batch_plan(self.strategy.dp_rank),
            )
            self._stream = source if isinstance(source, StreamBatches) else None
            self._batches = DevicePrefetcher(source, self.device,
                                             background=config.num_workers == 0)
        return self._batches

    def _next_batch(self) -> Batch:
        self.timer.wait_begin()
        inputs, target = next(self._batch_stream())
        self.timer.wait_end()
        self.timer.count_padding(self.workload.padding, inputs)
        return inputs, target

    def train_step(self) -> float:
        """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss
        (per loss unit over all ranks, when the workload declares units)."""
        timer, accum, counter = self.timer, self.config.grad_accum, self.counter
        # Weighing by loss units needs the whole step's count before the first backward.
        ahead = [self._next_batch() for _ in range(accum)] if counter.weighs_loss else []
        counts = counter.count([target for _, target in ahead]) if ahead else None
        losses, targets = [], []
        for micro in range(accum):
            inputs, target = ahead[micro] if ahead else self._next_batch()
            targets.append(target)
            timer.compute.begin()
            losses.append(self.strategy.forward_backward(
                inputs, target, counter.weighted(self.workload.loss_fn, counts), micro, accum,
                self.scaler))
            timer.comm.end_if_begun()
            timer.compute.end()
        self.position.batches_consumed += accum
        timer.optimizer.begin()
        self.strategy.finish_backward()
        loss = losses[0] if accum == 1 else torch.stack(losses).mean()
        loss_value = self.preemption.mean_loss(self.strategy.mean_loss, loss)
        self._optimizer_step(math.isfinite(loss_value))
        timer.optimizer.end()
        self.position.step += 1
        samples = counter.samples(targets, counts)
        self.position.samples_seen += samples
        window = timer.window
        window.steps += 1
        window.samples += samples
        window.loss_sum += loss_value
        return loss_value

    def _optimizer_step(self, finite: bool) -> None:
        """Update, or count a skipped step: a non-finite loss or an fp16 overflow."""
        self.nonfinite_streak = 0 if finite else self.nonfinite_streak + 1
        clip_at = self.config.clip_grad
        clip = (lambda: self.strategy.clip_grad_norm(clip_at)) if clip_at else None
        stepped = optimizer_step(self.optimizer, self.scheduler, self.scaler, clip, finite)
        self.position.skipped_steps += not stepped
        if stepped and self.average is not None:
            self.average.update()

    def run_steps(self, count: int) -> None:
        """Run up to ``count`` steps with everything a step entails: logging, evaluation
        and checkpoints on their schedules, and the non-finite-loss stop."""
        config = self.config
        for _ in range(min(count, self.total_steps - self.step)):
            self.train_step()
            if self.nonfinite_streak >= config.max_nonfinite_steps:
                raise self.state.diverged(self.nonfinite_streak)
            at_end = self.step == self.total_steps
            if at_end and self.average is not None:
                self.average.load_into_weights()
            if self.step % config.log_every == 0 or at_end:
                self._log_window()
            # Before evaluating, which can outlast the grace period; the last step included.
            if self.preemption.stop_agreed:
                raise self.preemption.stop(self.step, self.save_checkpoint, self.metrics.write)
            if config.eval_every and self.step % config.eval_every == 0 and not at_end:
                self.evaluate()
            if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                self.save_checkpoint()

    def fit(self) -> RunResult:
        """Train to ``total_steps``, save the final checkpoint, evaluate, write the summary.
        The checkpoint comes first: a stop signal during the evaluation then loses no step."""
        if self.is_main:
            self.progress.announce(record.banner(self.description))
        try:
            with self.preemption.handling():
                self.run_steps(self.total_steps - self.step)
                last = self.state.last
                if self.config.save_checkpoints and (last is None or last.step != self.step):
                    self.save_checkpoint()
                final = self.evaluate()
        finally:
            self.close()
        last, data = self.state.last, all_ranks_report(
            self.workload.data_report, self.strategy.dp_rank, self.dist.world_size)
        summary = record.write_summary(self.description, final, self.position,
                                       medians(self.metrics.step_records()), self.eval_time_s,
                                       last.path if last else None, data)
        return RunResult(self.run_dir, self.step, final, summary, self.model)

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None
        self.progress.close()
        self.metrics.close()
        chunked_loss.restore(self.workload)

    def save_checkpoint(self) -> Path:
        return self.state.save(self._stream, is_stream(self.workload.train_dataset)).path

    def _log_window(self) -> None:
        line = record.window_record(self.description, self.timer.close_window(),
                                    self.position, self.optimizer.param_groups[0]["lr"])
        self.metrics.write(line)
        self.progress.update(self.step, line)

    def evaluate(self) -> dict[str, float]:
        """Loss and the workload's metrics over the validation set (see
        :func:`gpuflow.train.evaluate.evaluate`), logged and shown."""
        if self.eval_set is None:
            return {}
        started = time.perf_counter()
        averaged = (self.average.weights_swapped_in() if self.average is not None
                    else contextlib.nullcontext())
        with averaged:
            result = evaluate(self.strategy, self.eval_set, self.workload, self.policy,
                              self.device, self.config.num_workers)
        seconds = time.perf_counter() - started
        self.eval_time_s += seconds
        self.metrics.write({"event": "eval", "step": self.step, "eval_s": seconds, **result})
        self.progress.message(f"eval @ step {self.step}: " + ", ".join(
            f"{name} {value:.4f}" for name, value in result.items()))
        return result

def train(workload: Workload, config: TrainConfig | None = None,
          progress: ProgressDisplay | None = None) -> RunResult:
    """Train ``workload`` as ``config`` says; the Python API behind `gpuflow train`."""
    return Trainer(workload, config or TrainConfig(), progress).fit()
