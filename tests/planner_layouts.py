"""Training steps of the planner's layouts on this machine, shared by the planner's tests
and benchmarks (planner_memory.py: peak memory, planner_steps.py: step times): the layout
applied to a workload's model the way the trainer applies it, without the trainer around
it, and its peak memory as torch's ``MemTracker`` counts it."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpuflow.config import TrainConfig
from gpuflow.planner.batch_size import FrozenTolerantTracker
from gpuflow.planner.layout import Layout
from gpuflow.train.optim import build_optimizer
from gpuflow.workload import Workload, call_model, resolve_workload

SMALL_GPT = "layers=2,dim=64,heads=2,seq=64"
# The same global batch of 8 for timing: tensor-parallel ranks share one micro-batch. At this
# size the pipeline's time goes to the schedule's per-micro-batch work, which the planner
# does not model, so it is timed at the larger size below.
TIMED_LAYOUTS = {
    "ddp": Layout(strategy="ddp", dp=2, micro_batch=4),
    "fsdp": Layout(strategy="fsdp", dp=2, micro_batch=4),
    "fsdp-no-reshard": Layout(strategy="fsdp", dp=2, reshard_after_forward=False, micro_batch=4),
    "fsdp-model": Layout(strategy="fsdp", dp=2, reshard_after_forward=False, fsdp_wrap="model",
                         micro_batch=4),
    "tp": Layout(strategy="tp", tp=2, micro_batch=8),
}
# Where compute dominates the frameworks' per-call costs, the pipeline is ranked too: with
# one micro-batch its bubble makes each rank wait through the other stage's whole share.
MEDIUM_GPT = "layers=4,dim=256,heads=4,seq=128"
COMPUTE_BOUND_LAYOUTS = {"ddp": Layout(strategy="ddp", dp=2, micro_batch=4),
                         "fsdp": Layout(strategy="fsdp", dp=2, micro_batch=4),
                         "pp": Layout(strategy="pp", pp=2, micro_batch=8)}


def batch_of(workload: Workload, size: int) -> tuple[Any, torch.Tensor]:
    inputs, target = workload.get_example_batch()

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t[:1].repeat(size, *[1] * (t.dim() - 1))  # a copy, not a view of the dataset

    return (tuple(rows(t) for t in inputs) if isinstance(inputs, tuple) else rows(inputs),
            rows(target))


def workload_of(name: str, size: str | None) -> Workload:
    return resolve_workload(name, {"data": "synthetic",
                                   **({"model_size": size} if size else {})})


def strategy_step(workload: Workload, layout: Layout) -> tuple[Any, nn.Module]:
    """``layout`` applied to the workload's model on this rank: a function that runs one
    forward and backward of a batch, and the module holding this rank's parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    from gpuflow.parallel.pipeline import Pipeline
    from gpuflow.parallel.replicated import apply_ddp
    from gpuflow.parallel.sharded import apply_fsdp
    from gpuflow.parallel.strategy import apply_activation_checkpointing, resize_rows
    from gpuflow.parallel.tensor import apply_tensor_parallel

    model, cpu = workload.model, torch.device("cpu")
    if layout.pp > 1:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
        example = resize_rows(workload.get_example_batch()[0], layout.micro_batch)
        pipe = Pipeline(model, workload.blocks(), example, mesh["pp"], "gpipe",
                        layout.grad_accum, workload.loss_fn, cpu)

        def pipelined(batch: Any) -> None:
            pipe.forward_backward(batch[0], batch[1], 1.0)
            pipe.sync_tied_grads()

        return pipelined, pipe.parts
    forward: Any = model
    if layout.activation_checkpointing:
        apply_activation_checkpointing(model, workload.blocks())
    if layout.strategy == "ddp":
        forward = apply_ddp(model, cpu)
    elif layout.strategy == "fsdp":
        param_dtype = torch.bfloat16 if layout.precision == "bf16" else None
        apply_fsdp(model, workload.blocks(), param_dtype, layout.reshard_after_forward,
                   wrap=layout.fsdp_wrap)
    elif layout.tp > 1:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(workload.blocks(), workload.tensor_parallel_plan, mesh["tp"])

    def plain(batch: Any) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=layout.precision == "bf16"):
            loss = workload.loss_fn(call_model(forward, batch[0]), batch[1])
        loss.backward()

    return plain, model


def training_step(forward_backward: Any, optimizer: Any, batch: Any) -> None:
    forward_backward(batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measured_peak(workload: Workload, layout: Layout) -> int:
    """Peak bytes of two training steps (forward, backward, AdamW step) of ``layout`` on
    this rank, counted by MemTracker: code independent of the planner's.

    The strategy is applied inside the tracker (DDP's buckets, FSDP's shards count), except
    a pipeline's, whose traced stage modules MemTracker must meet before it tracks them."""
    batch = batch_of(workload, layout.samples_per_step // layout.dp)  # data made outside
    tracker = FrozenTolerantTracker()  # MemTracker's count, a LoRA run's base frozen
    setup = contextlib.nullcontext() if layout.pp > 1 else tracker
    if layout.pp == 1:
        tracker.track_external(workload.model, batch)
    with setup:
        forward_backward, local = strategy_step(workload, layout)
        optimizer = build_optimizer(local, TrainConfig(), torch.device("cpu"))
    if layout.pp > 1:  # this rank's stage only: the whole model object stays with the caller
        tracker.track_external(local, optimizer, batch)
    with tracker:
        for _ in range(2):
            tracker.reset_mod_stats()  # each step a fresh peak in the per-module stats
            training_step(forward_backward, optimizer, batch)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def fastest_step_s(steps: dict[str, tuple[Any, Any, Any]], rounds: int, warmup: int
                   ) -> dict[str, float]:
    """Each (forward_backward, optimizer, batch)'s fastest training step over ``rounds``
    after ``warmup``, every rank in step. The steps take turns, so that the machine's drift
    hits all alike, and the fastest counts, since other load only ever slows a step."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(warmup + rounds):
        for name, (forward_backward, optimizer, batch) in steps.items():
            dist.barrier()
            start = time.perf_counter()
            training_step(forward_backward, optimizer, batch)
            dist.barrier()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: min(seconds) for name, seconds in times.items()}
