"""What a run says of itself: the banner it opens with, a record per logging window in
metrics.jsonl, and summary.json at the end (the run dir's contract, docs/run-dir.md)."""

from __future__ import annotations

import json
import platform
import time
from typing import TYPE_CHECKING, Any

import torch

from gpuflow.data.iterable import is_stream, resume_note
from gpuflow.devices import device_memory_bytes, device_name, native_bf16
from gpuflow.telemetry.steps import medians, peak_memory_bytes

if TYPE_CHECKING:
    from gpuflow.train.trainer import Trainer

RUN_FORMAT_VERSION = 1


def banner(trainer: Trainer) -> str:
    """One line: what runs where, how, for how long, and what was chosen for it."""
    config, dims, step = trainer.config, trainer.dims, trainer.position.step
    resumed = f", resumed at step {step}" if step else ""
    if step and is_stream(trainer.workload.train_dataset):
        resumed += f" ({resume_note(trainer.workload.train_dataset, trainer.exact_stream_resume)})"
    compiled = f", compiled ({trainer.compiled.scope})" if trainer.compiled else ""
    fp8 = f"{trainer.fp8.describe()}; " if trainer.fp8 else ""
    averaged = (f"weights averaged (EMA {trainer.average.decay:g} a step), "
                if trainer.average is not None else "")
    return (
        f"gpuflow: {trainer.workload.name} on {device_name(trainer.device)} ({trainer.device})"
        f"{trainer.strategy.describe()}, {trainer.policy.describe()}, global batch "
        f"{trainer.global_batch} = micro-batch {config.batch_size} x accum {config.grad_accum}"
        f" x data-parallel {dims.dp}, {fp8}{averaged}{trainer.total_steps} steps{resumed}"
        f"{compiled}; "
        f"{_eval_plan(trainer)}; run dir {trainer.run_dir}{_choices(trainer)}"
    )


def _choices(trainer: Trainer) -> str:
    """What --strategy auto and --batch-size auto chose."""
    chosen, dims, plan, probe = "", trainer.dims, trainer.plan, trainer.batch_probe
    if plan is not None:
        chosen += (f"; --strategy auto chose {dims.strategy} (dp {dims.dp} x tp {dims.tp} x "
                   f"pp {dims.pp}), predicted {plan.predicted_peak_bytes / 2**30:.2f} "
                   f"GiB and {plan.predicted_step_s * 1e3:.1f} ms per step")
    if probe is not None:
        chosen += (f"; --batch-size auto: {probe.largest_fitting} fit, running "
                   f"{trainer.config.batch_size} x accum {trainer.config.grad_accum}")
    return chosen


def _eval_plan(trainer: Trainer) -> str:
    if trainer.eval_set is None:
        return "no validation set"
    every = trainer.config.eval_every
    when = f"every {every} steps and at the end" if every else "at the end"
    return f"evaluates {trainer.eval_set.describe()} {when}"


def window_record(trainer: Trainer, window: dict[str, float]) -> dict[str, Any]:
    """One logging window's line of metrics.jsonl."""
    achieved = trainer.flops_per_step / window["step_time_s"] if window["step_time_s"] else 0.0
    peak_mem, _ = peak_memory_bytes(trainer.device)
    tokens = trainer.workload.tokens_per_sample
    measured = trainer.strategy.comm_measured
    position, world, peak = trainer.position, trainer.dims.world, trainer.peak.flops
    return {
        "step": position.step,
        "epoch": (position.batches_consumed / trainer.per_epoch_batches
                  if trainer.per_epoch_batches else None),
        "loss": window["loss"],
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "samples_per_s": window["samples_per_s"],
        "tokens_per_s": window["samples_per_s"] * tokens if tokens else None,
        "step_time_s": window["step_time_s"],
        "data_wait_s": window["data_wait_s"],
        "compute_s": window["compute_s"],
        "optimizer_s": window["optimizer_s"],
        "comm_s": window["comm_s"] if measured else None,
        "host_s": window["host_s"],
        "data_wait_frac": window["data_wait_frac"],
        "comm_frac": window["comm_frac"] if measured else None,
        "flops_per_step": trainer.flops_per_step,
        "achieved_flops": achieved,
        "mfu": achieved / (peak * world) if peak else None,
        "peak_mem_bytes": peak_mem,
        "skipped_steps": position.skipped_steps,
        "world_size": world,
        "window_steps": window["window_steps"],
        "elapsed_s": time.perf_counter() - trainer.started,
    }


def _plan_record(trainer: Trainer, peak_mem: int | None) -> dict[str, Any] | None:
    """What --strategy auto and --batch-size auto chose, predicted next to measured."""
    plan, probe = trainer.plan, trainer.batch_probe
    if plan is None and probe is None:
        return None
    record: dict[str, Any] = {
        "strategy_auto": plan.as_dict() if plan else None,
        "batch_size_auto": probe.as_dict() if probe else None,
    }
    if plan is not None:
        measured_step = medians(trainer.metrics.step_records()).get("step_time_s")
        # The planner predicts tensor memory: a CPU process's RSS, which also holds the
        # interpreter and its libraries, is no measurement of that.
        tensors = peak_mem if trainer.device.type == "cuda" else None
        record["predicted_vs_measured"] = {
            "peak_mem_bytes": [plan.predicted_peak_bytes, tensors],
            "step_time_s": [plan.predicted_step_s, measured_step],
        }
    return record


def write_summary(trainer: Trainer, final: dict[str, float]) -> dict[str, Any]:
    """summary.json, written atomically by the main process; every rank gets the dict."""
    peak_mem, mem_kind = peak_memory_bytes(trainer.device)
    config, dims, position, device = trainer.config, trainer.dims, trainer.position, \
        trainer.device
    summary = {
        "format_version": RUN_FORMAT_VERSION,
        "workload": trainer.workload.name,
        "steps": position.step,
        "samples_seen": position.samples_seen,
        "skipped_steps": position.skipped_steps,
        "wall_time_s": time.perf_counter() - trainer.started,
        "eval_time_s": trainer.eval_time_s,
        "evaluated": trainer.eval_set.describe() if trainer.eval_set is not None else None,
        "final_metrics": final,
        "median": medians(trainer.metrics.step_records()),
        "precision": config.precision,
        "precision_description": trainer.policy.describe(),
        "compiled": trainer.compiled is not None,
        "compile_scope": trainer.compiled.scope if trainer.compiled else None,
        "fp8": trainer.fp8.as_dict() if trainer.fp8 else None,
        "activation_checkpointing": config.activation_checkpointing,
        "ema_decay": trainer.average.decay if trainer.average is not None else None,
        "device": str(device),
        "device_name": device_name(device),
        "flops_per_step": trainer.flops_per_step,
        "trainable_params": trainer.trainable_params,
        "peak_flops": trainer.peak.flops,
        "peak_flops_source": trainer.peak.source,
        "peak_mem_bytes": peak_mem,
        "peak_mem_kind": mem_kind,
        "device_memory_bytes": device_memory_bytes(device),
        "native_bf16": native_bf16(device),
        "global_batch": trainer.global_batch,
        "strategy": dims.strategy,
        "world_size": dims.world,
        "mesh": {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp},
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "plan": _plan_record(trainer, peak_mem),
        "checkpoint": str(trainer.state.last.path) if trainer.state.last else None,
        "run_dir": str(trainer.run_dir),
        "config": config.to_dict(),
    }
    if trainer.is_main:
        tmp = trainer.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(trainer.run_dir / "summary.json")
    return summary
