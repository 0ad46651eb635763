"""`gpuflow plan`: predicted memory and step time of candidate plans, and the one to run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, get_args

from gpuflow.config import TrainConfig
from gpuflow.config_fields import LORA, OptimizerName
from gpuflow.errors import UserError
from gpuflow.options import add_flags, flags
from gpuflow.precision import PEAK_KEYS

if TYPE_CHECKING:
    from gpuflow.lora import LoraSpec

# The planner models the precisions that have a datasheet peak of their own (fp8 runs are
# planned as bf16 ones, gpuflow.train.auto).
PRECISIONS = PEAK_KEYS


def register(commands: Any) -> None:
    parser = commands.add_parser("plan", help="predict memory and step time of parallel plans")
    add = parser.add_argument
    add("--workload", default="textlm", help="built-in name or pkg.module:factory "
        "(built on the meta device where possible: nothing is allocated)")
    add("--model-size", help="the workload's model size preset or dimensions")
    add("--data", choices=["real", "synthetic"],
        help="data the workload is built with (default for the built-in workloads: "
             "synthetic, only shapes matter; your own factory is called without it)")
    add("--data-dir", help="the workload's data folder")
    add("--transformer", help="plan a transformer by dimensions instead of a workload: "
        "llama3-8b, or layers=L,dim=D,heads=H,vocab=V,seq=T[,kv_heads,ffn,gated,tied,bias]")
    add("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    add("--nodes", type=int, default=1, help="nodes (default 1)")
    add("--gpu-type", default="h100", help="h100, h200, a100-80g, ... (default h100)")
    add("--gpu-mem-gib", type=float, help="memory per GPU, GiB (default: the datasheet's)")
    add("--intra-bw", type=float, help="bandwidth inside a node, GB/s per GPU per direction")
    add("--inter-bw", type=float, help="bandwidth between nodes, GB/s per GPU per direction")
    add("--efficiency", type=float, help="fraction of the dense peak compute sustains")
    add("--global-batch", type=int, help="samples per optimizer step (default 8 per GPU)")
    add("--seq-len", type=int, help="tokens per sample (token models; default the model's)")
    add("--precision", default="bf16",
        help="comma-separated precisions to consider (default bf16)")
    add("--optimizer", default=TrainConfig.optimizer, choices=get_args(OptimizerName))
    add("--bucket-mb", type=float, help="ddp's gradient bucket size in MiB, as in train")
    add("--fsdp-prefetch", type=int, metavar="N",
        help="fsdp: blocks gathered ahead, as in train (holds N more gathered)")
    add("--no-pipeline", dest="pipeline", action="store_false",
        help="leave pipeline-parallel meshes out")
    add("--measure", action="store_true",
        help="on a GPU of --gpu-type: take the efficiency from the MFU of a short training "
             "run of the workload (and, with two GPUs, the link from an all-reduce probe)")
    add("--compile", action="store_true",
        help="with --measure: compile the measured run, as the training will be")
    add("--all", action="store_true", help="show every row, not only the best 20")
    add("--json", action="store_true", help="print JSON")
    add_flags(parser, TrainConfig, only=LORA)  # the base frozen, as `gpuflow train` has them
    parser.set_defaults(handler=run)


def _precisions(text: str) -> list[str]:
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PRECISIONS]
    if unknown or not chosen:
        raise UserError(f"--precision: unknown {', '.join(unknown) or 'empty'}; "
                        f"choose from {', '.join(PRECISIONS)}.")
    return chosen


def _profiles(args: argparse.Namespace, precisions: list[str], devices: int,
              adapters: LoraSpec | None) -> dict[str, Any]:
    from gpuflow.planner.transformer import parse_transformer
    from gpuflow.planner.workload_profile import profile_workload

    if args.transformer:
        if adapters is not None:
            raise UserError("--lora-rank plans adapters on a model, and --transformer gives "
                            "only dimensions: plan a --workload (hf:DIR, textlm).")
        dims = parse_transformer(args.transformer)
        if args.seq_len:
            from dataclasses import replace
            dims = replace(dims, seq=args.seq_len)
        return {p: dims.profile(p) for p in precisions}
    if adapters is None:
        workload = _build_workload(args)
        return {p: profile_workload(workload, p, args.seq_len, fsdp=devices > 1)
                for p in precisions}
    # The base is held in a dtype that depends on the precision: one model for each.
    return {p: profile_workload(_with_adapters(args, adapters, p), p, args.seq_len,
                                fsdp=devices > 1) for p in precisions}


def _with_adapters(args: argparse.Namespace, adapters: LoraSpec, precision: str) -> Any:
    """The workload with the adapters `gpuflow train` would give it under ``precision``, its
    base frozen and held as the trainer holds it."""
    from gpuflow import lora
    from gpuflow.precision import autocast_dtype

    workload = _build_workload(args, frozen_precision=precision)
    lora.wrap(workload.model, adapters, autocast_dtype(precision))  # in place, as PEFT does
    return workload


def _build_workload(args: argparse.Namespace, meta: bool = True,
                    frozen_precision: str | None = None) -> Any:
    """On the meta device when the factory allows it (no memory, no initialisation), unless
    the model is to run."""
    from functools import partial

    import torch

    from gpuflow.workload import is_builtin, resolve_workload

    options = {}
    if args.data or is_builtin(args.workload):
        options["data"] = args.data or "synthetic"
    if args.model_size:
        options["model_size"] = args.model_size
    if args.data_dir:
        options["data_dir"] = args.data_dir
    # Given only for adapters: a full fine-tune's workload is built as it always was.
    held = {"frozen_precision": frozen_precision} if frozen_precision else {}
    build = partial(resolve_workload, args.workload, options, **held)
    if not meta:
        return build()
    try:
        with torch.device("meta"):
            return build()
    except UserError:
        raise
    except Exception as exc:
        reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    workload = build()
    weights = sum(p.numel() * p.element_size() for p in workload.model.parameters())
    size = f"{weights / 2**30:.2f} GiB" if weights >= 2**30 else f"{weights / 2**20:.2f} MiB"
    warnings.warn(f"Workload {args.workload!r} cannot be built on the meta device ({reason}), "
                  f"so it was built for real: {size} of weights allocated and initialised in "
                  "this process's memory.", stacklevel=2)
    return workload


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gpuflow.lora import LoraSpec
    from gpuflow.planner.layout import RunSettings
    from gpuflow.planner.machine import gpu_hardware
    from gpuflow.planner.search import recommendation, search

    precisions = _precisions(args.precision)
    # The run's fixed knobs, checked as `gpuflow train --strategy auto` checks them: each
    # tunes the layouts that use it among those searched.
    lora_flags = {flag.name: getattr(args, flag.name) for flag in flags(TrainConfig)
                  if flag.option.group == LORA and hasattr(args, flag.name)}
    fixed = TrainConfig(strategy="auto", optimizer=args.optimizer, bucket_mb=args.bucket_mb,
                        fsdp_prefetch=args.fsdp_prefetch, **lora_flags)
    fixed.validate()
    adapters = LoraSpec.of(vars(fixed))
    hardware = gpu_hardware(args.gpu_type, args.gpus, args.nodes, args.gpu_mem_gib,
                            args.intra_bw, args.inter_bw, args.efficiency)
    global_batch = args.global_batch or 8 * hardware.devices
    if global_batch < 1:
        raise UserError(f"--global-batch must be at least 1 (got {global_batch}).")
    notes: list[str] = []
    measured = None
    if args.measure:
        if adapters is not None:
            raise UserError("plan --measure trains every weight of the model, not adapters: "
                            "give --efficiency with --lora-rank.")
        hardware, notes, measured = _calibrate(args, hardware, precisions[0],
                                               max(1, global_batch // hardware.devices))
    profiles = _profiles(args, precisions, hardware.devices, adapters)
    plans = search(profiles, hardware, global_batch, pipeline=args.pipeline,
                   settings=RunSettings.of(fixed))
    if not plans:
        raise UserError(f"No mesh of {hardware.devices} devices divides a global batch of "
                        f"{global_batch}; choose a multiple of the device count.")
    reason = recommendation(plans, hardware)
    profile = next(iter(profiles.values()))
    if args.json:
        print(json.dumps({
            "hardware": {"name": hardware.name, "devices": hardware.devices,
                         "memory_bytes": hardware.memory_bytes,
                         "efficiency": hardware.efficiency,
                         "efficiency_source": hardware.efficiency_source,
                         "intra": hardware.intra.__dict__, "inter": hardware.inter.__dict__,
                         "peak_flops": hardware.peak_flops, "source": hardware.source},
            "model": {k: dataclasses.asdict(v) for k, v in profiles.items()},
            "global_batch": global_batch, "calibration": notes,
            "measured_run": measured.as_dict() if measured else None,
            "plans": [p.as_dict() for p in plans],
            "recommended": plans[0].as_dict() if plans[0].fits else None,
            "reason": reason,
        }, indent=2))
        return 0
    _print_table(plans if args.all else plans[:20], hardware, profile, global_batch, notes)
    print(reason)
    return 0


def _calibrate(args: argparse.Namespace, hardware: Any, precision: str, micro_batch: int
               ) -> tuple[Any, list[str], Any]:
    """Refuse unless this machine is a --gpu-type GPU, then measure the real model on it."""
    from gpuflow.planner.measure import calibrate, check_measurable
    from gpuflow.train.calibrate import measure_efficiency

    check_measurable(args.gpu_type)
    if args.transformer:
        raise UserError("plan --measure trains the real model, and --transformer gives only "
                        "dimensions: plan a --workload, or give --efficiency.")
    measured = measure_efficiency(_build_workload(args, meta=False), precision, micro_batch,
                                  compile=args.compile)
    hardware, notes = calibrate(hardware, measured.efficiency, measured.describe())
    return hardware, notes, measured


def _print_table(plans: Sequence[Any], hardware: Any, profile: Any, global_batch: int,
                 notes: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    gib = 2**30
    console = Console(width=None if sys.stdout.isatty() else 180)
    frozen = (f" ({profile.trained_params / 1e6:,.2f}M of them train; the frozen rest held "
              f"in {profile.frozen_bytes / gib:.2f} GiB)" if profile.trained_fraction < 1 else "")
    console.print(
        f"[bold]{profile.name}[/]: {profile.params / 1e6:,.1f}M parameters{frozen}, "
        f"{profile.layers} blocks, {profile.flops_per_sample / 1e9:,.1f} GFLOP per sample "
        f"(fwd+bwd), activations {profile.source}; global batch {global_batch}")
    console.print(
        f"{hardware.devices} x {hardware.name} ({hardware.memory_bytes / gib:.0f} GiB; "
        f"{hardware.intra.name} {hardware.intra.bandwidth / 1e9:.0f} GB/s inside a node, "
        f"{hardware.inter.name} {hardware.inter.bandwidth / 1e9:.0f} GB/s between nodes); "
        f"compute at {hardware.efficiency:.2f} of the dense peak ({hardware.efficiency_source})")
    for note in notes:
        console.print(f"measured: {note}")
    table = Table(title="Candidate plans (memory in GiB per device, time in s per step)")
    for column in ("plan", "prec", "AC", "mb x acc", "params", "grads", "optim", "activ",
                   "temp", "overh", "peak", "compute", "recomp", "comm", "exposed",
                   "bubble", "step", "fits"):
        table.add_column(column, justify="left" if column in ("plan", "fits") else "right")
    for plan in plans:
        m, t, lay = plan.memory, plan.time, plan.layout
        table.add_row(
            lay.describe(), lay.precision, "on" if lay.activation_checkpointing else "off",
            f"{lay.micro_batch} x {lay.grad_accum}",
            *(f"{v / gib:.2f}" for v in (m.parameters, m.gradients, m.optimizer,
                                         m.activations, m.temporary, m.overhead, m.peak)),
            *(f"{v:.3g}" for v in (t.compute_s, t.recompute_s, t.comm_s, t.exposed_comm_s,
                                   t.bubble_s, t.step_s)),
            "yes" if plan.fits else "[red]NO[/]",
        )
    console.print(table)
