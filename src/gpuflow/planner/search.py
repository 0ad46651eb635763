"""Enumerate candidate plans, predict each, and pick the fastest one that fits."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpuflow.config_checks import lora_layout_refusal
from gpuflow.devices import cpu_peak, total_memory
from gpuflow.errors import UserError
from gpuflow.parallel.dims import ParallelDims
from gpuflow.planner.cost import StepTime, predict_step_time
from gpuflow.planner.layout import DEFAULT_SETTINGS, Layout, RunSettings
from gpuflow.planner.machine import (
    GPU_TYPES,
    Hardware,
    cpu_hardware,
    gpu_hardware,
    gpu_type_of,
)
from gpuflow.planner.memory import MemoryBreakdown, predict_memory
from gpuflow.planner.profile import ModelProfile
from gpuflow.planner.workload_profile import profile_workload, tensor_parallel_plan
from gpuflow.workload import Workload


@dataclass(frozen=True)
class Plan:
    """A layout with its predictions. The fields the trainer applies are properties."""

    layout: Layout
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    tokens_per_sample: int | None = None

    strategy = property(lambda self: self.layout.strategy)
    dp = property(lambda self: self.layout.dp)
    tp = property(lambda self: self.layout.tp)
    pp = property(lambda self: self.layout.pp)
    reshard_after_forward = property(lambda self: self.layout.reshard_after_forward)
    fsdp_wrap = property(lambda self: self.layout.fsdp_wrap)
    activation_checkpointing = property(lambda self: self.layout.activation_checkpointing)
    micro_batch = property(lambda self: self.layout.micro_batch)
    grad_accum = property(lambda self: self.layout.grad_accum)
    predicted_peak_bytes = property(lambda self: self.memory.peak)
    predicted_step_s = property(lambda self: self.time.step_s)

    @property
    def samples_per_s(self) -> float:
        return self.layout.samples_per_step / self.time.step_s

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the layout, memory in bytes, times in seconds."""
        layout = self.layout
        return {
            "strategy": layout.strategy, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
            "reshard_after_forward": layout.reshard_after_forward,
            "fsdp_wrap": layout.fsdp_wrap, "fsdp_prefetch": layout.fsdp_prefetch,
            "precision": layout.precision,
            "activation_checkpointing": layout.activation_checkpointing,
            "micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum,
            "global_batch": layout.samples_per_step, "fits": self.fits,
            "memory_bytes": self.memory.as_dict(),
            "step_time_s": {
                "compute": self.time.compute_s, "recompute": self.time.recompute_s,
                "bubble": self.time.bubble_s, "comm": self.time.comm_s,
                "exposed_comm": self.time.exposed_comm_s,
                "overlapped_comm": self.time.overlapped_comm_s, "step": self.time.step_s,
                "collectives": [c.__dict__ for c in self.time.collectives],
            },
            "samples_per_s": self.samples_per_s,
            "tokens_per_s_per_device": (self.samples_per_s * self.tokens_per_sample
                                        / layout.world if self.tokens_per_sample else None),
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(world: int, global_batch: int, precisions: Sequence[str],
                      layers: int, tensor_parallel: bool, pipeline: bool,
                      gpus_per_node: int, settings: RunSettings = DEFAULT_SETTINGS
                      ) -> Iterator[Layout]:
    """Every mesh dp x tp x pp of ``world`` ranks and every strategy the trainer runs on it
    (:meth:`ParallelDims.runnable`), with adapters where it trains them.

    Tensor parallelism stays inside a node; pipeline stages need at least one block each;
    micro-batches are the divisors of the per-replica batch. A run that prefetches FSDP's
    blocks shards per block.
    """
    for tp in _divisors(world) if tensor_parallel else [1]:
        if tp > gpus_per_node:
            continue
        for pp in _divisors(world // tp) if pipeline else [1]:
            if pp > max(1, layers):
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            for dims in ParallelDims.runnable(dp, tp, pp, fsdp_prefetch=settings.fsdp_prefetch,
                                              bucket_mb=settings.bucket_mb):
                if settings.lora_rank is not None and lora_layout_refusal(
                        dims.strategy, dims.tp, dims.pp, settings.quantize_base):
                    continue
                for precision in precisions:
                    for checkpointing in (False, True):
                        for micro in _divisors(global_batch // dp):
                            yield Layout(**dims.as_dict(), optimizer=settings.optimizer,
                                         precision=precision,
                                         activation_checkpointing=checkpointing,
                                         micro_batch=micro,
                                         grad_accum=global_batch // (dp * micro))


def evaluate(profiles: dict[str, ModelProfile], layout: Layout, hardware: Hardware) -> Plan:
    profile = profiles[layout.precision]
    memory = predict_memory(profile, layout, hardware.framework_overhead)
    time = predict_step_time(profile, layout, hardware)
    return Plan(layout, memory, time, memory.peak <= hardware.memory_bytes,
                profile.tokens_per_sample)


def search(profiles: dict[str, ModelProfile], hardware: Hardware, global_batch: int,
           tensor_parallel: bool = True, pipeline: bool = True,
           settings: RunSettings = DEFAULT_SETTINGS) -> list[Plan]:
    """One row per (strategy, mesh, precision, checkpointing): its fastest micro-batch that
    fits, or its smallest if none does. Sorted: fitting plans fastest first, then the rest."""
    layers = next(iter(profiles.values())).layers
    best: dict[tuple[Any, ...], Plan] = {}
    for layout in candidate_layouts(hardware.devices, global_batch, list(profiles), layers,
                                    tensor_parallel, pipeline, hardware.gpus_per_node,
                                    settings):
        plan = evaluate(profiles, layout, hardware)
        key = (layout.strategy, layout.reshard_after_forward, layout.fsdp_wrap, layout.dp,
               layout.tp, layout.pp, layout.precision, layout.activation_checkpointing)
        current = best.get(key)
        if current is None or _rank(plan) < _rank(current):
            best[key] = plan
    return sorted(best.values(), key=_rank)


def _rank(plan: Plan) -> tuple[bool, float, float, int, float]:
    """Fitting plans first, fastest first; among equally fast ones (to 0.1%) the larger
    micro-batch, which keeps a real device busier than the model of compute says, then the
    fewer collective calls: each costs the frameworks' hooks and copies around it and a
    point where every rank waits for the slowest, which the model of time leaves out (on 2
    gloo ranks ddp, fsdp as one unit and fsdp per block measured in that order)."""
    step = float(f"{plan.time.step_s:.3g}")
    calls = sum(c.count for c in plan.time.collectives)
    if plan.fits:
        return (False, step, -plan.layout.micro_batch, calls, plan.memory.peak)
    return (True, plan.memory.peak, step, -plan.layout.micro_batch, calls)


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def recommendation(plans: Sequence[Plan], hardware: Hardware) -> str:
    """One paragraph: what to run, what it costs, and why it beats the runner-up."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        smallest = min(plans, key=lambda p: p.memory.peak)
        return (f"No plan fits in {_gib(hardware.memory_bytes)} per device: the smallest, "
                f"{smallest.layout.describe()} with activation checkpointing "
                f"{'on' if smallest.activation_checkpointing else 'off'} and micro-batch "
                f"{smallest.micro_batch}, needs {_gib(smallest.memory.peak)}. Add devices, "
                "lower the precision or shorten the sequence.")
    best = fitting[0]
    b, t = best.layout, best.time
    text = (f"Run {b.describe()} in {b.precision}, activation checkpointing "
            f"{'on' if b.activation_checkpointing else 'off'}, micro-batch {b.micro_batch} x "
            f"{b.grad_accum} accumulation: predicted {t.step_s:.3g} s per step "
            f"({t.compute_s:.3g} s compute, {t.recompute_s:.3g} s recompute, "
            f"{t.exposed_comm_s:.3g} s exposed of {t.comm_s:.3g} s communication, "
            f"{t.bubble_s:.3g} s pipeline bubble) and a peak of {_gib(best.memory.peak)} of "
            f"{_gib(hardware.memory_bytes)} per device. It is the fastest of the "
            f"{len(fitting)} plans that fit ({len(plans) - len(fitting)} do not)")
    if len(fitting) > 1:
        second = fitting[1]
        s = second.time
        parts = {"compute": s.compute_s - t.compute_s,
                 "recompute": s.recompute_s - t.recompute_s,
                 "exposed communication": s.exposed_comm_s - t.exposed_comm_s,
                 "pipeline bubble": s.bubble_s - t.bubble_s}
        cause = max(parts, key=lambda k: parts[k])
        text += (f"; the runner-up, {second.layout.describe()} in {second.layout.precision} "
                 f"with checkpointing {'on' if second.activation_checkpointing else 'off'}, "
                 f"is {100 * (s.step_s / t.step_s - 1):.1f}% slower, mostly in {cause}")
    return text + "."


def local_hardware(devices: int) -> Hardware:
    """The machine this process runs on, as the planner describes it."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        key = gpu_type_of(name)
        if key is None:
            raise UserError(f"The planner has no figures for {name!r}; "
                            f"known GPU types: {', '.join(GPU_TYPES)}.")
        per_node = min(devices, torch.cuda.device_count())
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        return gpu_hardware(key, per_node, max(1, devices // per_node), memory)
    peaks = {key: cpu_peak(key).flops or 1.0 for key in ("fp32", "tf32", "bf16", "fp16")}
    return cpu_hardware(devices, peaks, total_memory() or 2**34)


def choose_plan(workload: Workload, config_like: Any, devices: int | Hardware,
                pipeline: bool = False) -> Plan:
    """The plan ``gpuflow train --strategy auto`` runs.

    ``config_like`` supplies ``precision``, ``batch_size`` and ``grad_accum`` (their product
    times the number of devices is the global batch kept fixed) and the
    :class:`RunSettings` fields; any missing one takes TrainConfig's default. ``devices`` is
    a world size on this machine or a :class:`Hardware`. Pipeline plans are offered only
    with ``pipeline=True``. Raises UserError when nothing fits.
    """
    hardware = devices if isinstance(devices, Hardware) else local_hardware(devices)
    precision = getattr(config_like, "precision", "fp32")
    global_batch = (getattr(config_like, "batch_size", 64) * getattr(config_like, "grad_accum", 1)
                    * hardware.devices)
    profiles = {precision: profile_workload(workload, precision,
                                            fsdp=hardware.devices > 1)}
    plans = search(profiles, hardware, global_batch,
                   tensor_parallel=tensor_parallel_plan(workload) is not None,
                   pipeline=pipeline, settings=RunSettings.of(config_like))
    if not plans or not plans[0].fits:
        raise UserError(recommendation(plans, hardware) if plans else
                        f"No plan divides a global batch of {global_batch} over "
                        f"{hardware.devices} devices.")
    return plans[0]

