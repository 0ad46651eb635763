"""What a run says of itself: the banner it opens with, a record per logging window in
metrics.jsonl, and summary.json at the end (the run dir's contract, docs/run-dir.md).

Everything here reads one :class:`RunDescription`, fixed once the run is set up, and the
figures that move (its position, the learning rate, the timings) handed in as they are.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpuflow.devices import PeakFlops, device_memory_bytes, device_name, native_bf16
from gpuflow.parallel.dims import ParallelDims
from gpuflow.serving import SERVING_FILE
from gpuflow.telemetry.steps import peak_memory_bytes

if TYPE_CHECKING:
    from gpuflow.planner.search import Plan
    from gpuflow.train.auto import BatchProbe
    from gpuflow.train.compile import Compiled
    from gpuflow.train.fp8 import Fp8Conversion
    from gpuflow.train.state import Position

RUN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class RunDescription:
    """A run as set up: what runs where and how, what was chosen for it, and its figures
    that do not change while it runs. ``config`` is the run's configuration as saved;
    ``evaluated`` what each evaluation reads (None: no validation set);
    ``layout`` and ``precision`` the strategy's and the precision policy's descriptions;
    ``started`` a ``time.perf_counter()`` reading; ``resume_note`` what a resumed stream
    says of its position."""

    workload: str
    tokens_per_sample: int | None
    device: torch.device
    dims: ParallelDims
    layout: str
    precision: str
    config: Mapping[str, Any]
    global_batch: int
    total_steps: int
    start_step: int
    per_epoch_batches: int | None
    flops_per_step: int
    trainable_params: int
    peak: PeakFlops
    comm_measured: bool
    run_dir: Path
    is_main: bool
    started: float
    evaluated: str | None = None
    compiled: Compiled | None = None
    fp8: Fp8Conversion | None = None
    ema_decay: float | None = None
    resume_note: str | None = None
    plan: Plan | None = None
    batch_probe: BatchProbe | None = None


def run_dir(given: str | None, workload: str) -> Path:
    """``--run-dir``, or ``runs/<workload>-<timestamp>``."""
    if given:
        return Path(given)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = workload.replace(":", "-").replace("/", "-").replace(".", "-")
    return Path("runs") / f"{safe}-{stamp}"


def write_run_files(run: RunDescription, serving_state: Mapping[str, Any]) -> None:
    """config.json, and serving.json: what a server needs to decode requests without the
    training data or code (main process only)."""
    if not run.is_main:
        return
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "config.json").write_text(json.dumps(dict(run.config), indent=2))
    (run.run_dir / SERVING_FILE).write_text(json.dumps(dict(serving_state)))


def banner(run: RunDescription) -> str:
    """One line: what runs where, how, for how long, and what was chosen for it."""
    config, dims, step = run.config, run.dims, run.start_step
    resumed = f", resumed at step {step}" if step else ""
    if step and run.resume_note:
        resumed += f" ({run.resume_note})"
    compiled = f", compiled ({run.compiled.scope})" if run.compiled else ""
    fp8 = f"{run.fp8.describe()}; " if run.fp8 else ""
    averaged = (f"weights averaged (EMA {run.ema_decay:g} a step), "
                if run.ema_decay is not None else "")
    adapters = (f"LoRA rank {config['lora_rank']} on {config['lora_targets']} "
                f"({run.trainable_params:,} parameters train, the base frozen"
                f"{' in NF4' if config.get('quantize_base') else ''}), "
                if config.get("lora_rank") is not None else "")
    return (
        f"gpuflow: {run.workload} on {device_name(run.device)} ({run.device})"
        f"{run.layout}, {run.precision}, global batch "
        f"{run.global_batch} = micro-batch {config['batch_size']} x accum "
        f"{config['grad_accum']} x data-parallel {dims.dp}, {adapters}{fp8}{averaged}"
        f"{run.total_steps} "
        f"steps{resumed}{compiled}; "
        f"{_eval_plan(run)}; run dir {run.run_dir}{_choices(run)}"
    )


def _choices(run: RunDescription) -> str:
    """What --strategy auto and --batch-size auto chose."""
    chosen, dims, plan, probe = "", run.dims, run.plan, run.batch_probe
    if plan is not None:
        chosen += (f"; --strategy auto chose {dims.strategy} (dp {dims.dp} x tp {dims.tp} x "
                   f"pp {dims.pp}), predicted {plan.predicted_peak_bytes / 2**30:.2f} "
                   f"GiB and {plan.predicted_step_s * 1e3:.1f} ms per step")
    if probe is not None:
        chosen += (f"; --batch-size auto: {probe.largest_fitting} fit, running "
                   f"{run.config['batch_size']} x accum {run.config['grad_accum']}")
    return chosen


def _eval_plan(run: RunDescription) -> str:
    if run.evaluated is None:
        return "no validation set"
    every = run.config["eval_every"]
    when = f"every {every} steps and at the end" if every else "at the end"
    return f"evaluates {run.evaluated} {when}"


def window_record(run: RunDescription, window: dict[str, float], position: Position,
                  lr: float) -> dict[str, Any]:
    """One logging window's line of metrics.jsonl, at ``position`` with learning rate
    ``lr``."""
    achieved = run.flops_per_step / window["step_time_s"] if window["step_time_s"] else 0.0
    peak_mem, _ = peak_memory_bytes(run.device)
    tokens = run.tokens_per_sample
    measured = run.comm_measured
    world, peak = run.dims.world, run.peak.flops
    return {
        "step": position.step,
        "epoch": (position.batches_consumed / run.per_epoch_batches
                  if run.per_epoch_batches else None),
        "loss": window["loss"],
        "lr": lr,
        "samples_per_s": window["samples_per_s"],
        "tokens_per_s": window["samples_per_s"] * tokens if tokens else None,
        "step_time_s": window["step_time_s"],
        "data_wait_s": window["data_wait_s"],
        "compute_s": window["compute_s"],
        "optimizer_s": window["optimizer_s"],
        "comm_s": window["comm_s"] if measured else None,
        "host_s": window["host_s"],
        "data_wait_frac": window["data_wait_frac"],
        "padding_frac": window.get("padding_frac"),
        "comm_frac": window["comm_frac"] if measured else None,
        "flops_per_step": run.flops_per_step,
        "achieved_flops": achieved,
        "mfu": achieved / (peak * world) if peak else None,
        "peak_mem_bytes": peak_mem,
        "skipped_steps": position.skipped_steps,
        "world_size": world,
        "window_steps": window["window_steps"],
        "elapsed_s": time.perf_counter() - run.started,
    }


def _plan_record(run: RunDescription, peak_mem: int | None, median: Mapping[str, float]
                 ) -> dict[str, Any] | None:
    """What --strategy auto and --batch-size auto chose, predicted next to measured."""
    plan, probe = run.plan, run.batch_probe
    if plan is None and probe is None:
        return None
    record: dict[str, Any] = {
        "strategy_auto": plan.as_dict() if plan else None,
        "batch_size_auto": probe.as_dict() if probe else None,
    }
    if plan is not None:
        # The planner predicts tensor memory: a CPU process's RSS, which also holds the
        # interpreter and its libraries, is no measurement of that.
        tensors = peak_mem if run.device.type == "cuda" else None
        record["predicted_vs_measured"] = {
            "peak_mem_bytes": [plan.predicted_peak_bytes, tensors],
            "step_time_s": [plan.predicted_step_s, median.get("step_time_s")],
        }
    return record


def write_summary(run: RunDescription, final: dict[str, float], position: Position,
                  median: Mapping[str, float], eval_time_s: float,
                  checkpoint: Path | None, data: Mapping[str, Any] | None = None
                  ) -> dict[str, Any]:
    """summary.json, written atomically by the main process; every rank gets the dict.
    ``median`` holds the step records' medians, ``checkpoint`` the last one saved, ``data``
    the workload's report on its data (``Workload.data_report``)."""
    peak_mem, mem_kind = peak_memory_bytes(run.device)
    config, dims, device = run.config, run.dims, run.device
    summary = {
        "format_version": RUN_FORMAT_VERSION,
        "workload": run.workload,
        "steps": position.step,
        "samples_seen": position.samples_seen,
        "skipped_steps": position.skipped_steps,
        "wall_time_s": time.perf_counter() - run.started,
        "eval_time_s": eval_time_s,
        "evaluated": run.evaluated,
        "final_metrics": final,
        "data": dict(data) if data is not None else None,
        "median": dict(median),
        "precision": config["precision"],
        "precision_description": run.precision,
        "compiled": run.compiled is not None,
        "compile_scope": run.compiled.scope if run.compiled else None,
        "fp8": run.fp8.as_dict() if run.fp8 else None,
        "activation_checkpointing": config["activation_checkpointing"],
        "ema_decay": run.ema_decay,
        "device": str(device),
        "device_name": device_name(device),
        "flops_per_step": run.flops_per_step,
        "trainable_params": run.trainable_params,
        "peak_flops": run.peak.flops,
        "peak_flops_source": run.peak.source,
        "peak_mem_bytes": peak_mem,
        "peak_mem_kind": mem_kind,
        "device_memory_bytes": device_memory_bytes(device),
        "native_bf16": native_bf16(device),
        "global_batch": run.global_batch,
        "strategy": dims.strategy,
        "world_size": dims.world,
        "mesh": {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp},
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "plan": _plan_record(run, peak_mem, median),
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "run_dir": str(run.run_dir),
        "config": dict(config),
    }
    if run.is_main:
        tmp = run.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(run.run_dir / "summary.json")
    return summary
