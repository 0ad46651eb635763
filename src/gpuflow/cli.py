"""The `gpuflow` command: parses flags and hands over; no training logic lives here."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuflow.errors import (
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    NonFiniteLossError,
    Preempted,
    UserError,
)

EXIT_DIVERGED = 3
EXIT_WORKER_FAILED = 1


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """`gpuflow train`'s flags: one per TrainConfig field, generated from its declaration
    (gpuflow.config), after the flags that are not fields."""
    from gpuflow.config import TrainConfig
    from gpuflow.options import add_flags

    parser.add_argument(
        "--config", metavar="FILE",
        help="TOML file of these settings, each keyed by its flag's name (batch-size = 32; "
             "save-checkpoints = false for --no-checkpoints); flags override it; an unknown "
             "key is an error")
    add_flags(parser, TrainConfig)


# Subcommands that live in their own module under gpuflow.commands: each module has
# `register(commands)`, which adds its parser and sets `handler(args, argv) -> exit code`.
_COMMAND_MODULES: tuple[str, ...] = ("report", "data", "serve", "predict", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuflow", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a workload",
                                argument_default=argparse.SUPPRESS)
    add_train_flags(train)
    train.set_defaults(handler=_train)
    export = commands.add_parser(
        "export", help="write a run's weights as one safetensors file or a Hugging Face model")
    export.add_argument("run_dir", help="a gpuflow run dir")
    export.add_argument("--out", required=True,
                        help="output .safetensors file, or directory for --format hf")
    export.add_argument("--format", choices=["safetensors", "hf"], default="safetensors",
                        help="safetensors (default): one file gpuflow serve reads; hf: a "
                             "directory transformers' from_pretrained opens (needs "
                             "gpuflow[hf])")
    export.add_argument("--merge", action="store_true",
                        help="a LoRA run: the base with the adapters merged into it (with "
                             "--format hf, a whole model directory instead of PEFT's adapter "
                             "files)")
    export.set_defaults(handler=_export)
    env = commands.add_parser("env", help="devices, versions and the peak FLOP/s used for MFU")
    env.add_argument("--json", action="store_true", help="print JSON")
    env.set_defaults(handler=_env)
    for name in _COMMAND_MODULES:
        importlib.import_module(f"gpuflow.commands.{name}").register(commands)
    return parser


def _train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gpuflow.config import build_config, load_toml
    from gpuflow.parallel.env import context_from_env, set_cpu_threads, shutdown
    from gpuflow.train.progress import print_summary
    from gpuflow.train.trainer import seed_everything, train
    from gpuflow.workload import resolve_workload

    flags: dict[str, Any] = {k: v for k, v in vars(args).items()
                             if k not in ("command", "config", "handler")}
    base: dict[str, Any] = {}
    if flags.get("resume"):
        resume = flags["resume"]
        run_dir = resume if isinstance(resume, str) else flags.get("run_dir")
        if run_dir is None:
            raise UserError("--resume needs a run dir: --resume DIR, or --resume --run-dir DIR.")
        base = _saved_config(Path(run_dir))
        flags["run_dir"] = run_dir
    file_values = load_toml(args.config) if getattr(args, "config", None) else {}
    config = build_config({**base, **file_values}, flags)
    if (config.nproc > 1 or config.nnodes > 1) and context_from_env() is None:
        return _launch(config, argv)
    if _restarted_by_elastic_agent(config):
        config.resume = True
    if context_from_env() is None and "OMP_NUM_THREADS" not in os.environ:
        crowded = set_cpu_threads()  # torchrun's workers get theirs in init_distributed
        if crowded:
            print(f"gpuflow: {crowded}", file=sys.stderr)
    seed_everything(config.seed)
    workload = resolve_workload(config.workload, config.workload_options(),
                                frozen_precision=config.frozen_precision())
    try:
        result = train(workload, config)
    finally:
        shutdown()
    launched = context_from_env()
    if launched is None or launched.is_main:
        print_summary(result.summary)
    return 0


def _launch(config: Any, argv: Sequence[str]) -> int:
    """This process becomes the elastic agent; workers rerun the same command line."""
    from gpuflow.parallel.launch import LaunchSpec, launch
    from gpuflow.train.record import run_dir

    directory = str(run_dir(config.run_dir, config.workload))
    spec = LaunchSpec(config.nproc, config.nnodes, config.node_rank, config.rdzv_endpoint,
                      config.max_restarts)
    launch(spec, [*argv, "--run-dir", directory])
    return 0


def _restarted_by_elastic_agent(config: Any) -> bool:
    """After a worker failure the agent restarts every worker: continue from the checkpoint."""
    from gpuflow.checkpoint import list_checkpoints

    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restarts == 0 or config.resume or config.run_dir is None:
        return False
    return bool(list_checkpoints(Path(config.run_dir) / "checkpoints"))


def _saved_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.json"
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"--resume: {run_dir} is not a gpuflow run dir (no config.json).") from None
    saved.pop("extra", None)
    saved.pop("resume", None)
    return saved


def _export(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gpuflow.export import export_model

    path, step = export_model(Path(args.run_dir), Path(args.out), args.format, args.merge)
    print(f"exported step {step} of {args.run_dir} to {path}"
          + (" (Hugging Face format)" if args.format == "hf" else ""))
    return 0


def _env(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import torch

    from gpuflow.devices import environment_report, peak_flops, resolve_device

    report = environment_report()
    device = resolve_device("auto")
    peaks = {}
    for key in ("fp32", "bf16", "fp16"):
        peak = peak_flops(device, key)
        peaks[key] = {"flops": peak.flops, "source": peak.source}
    report["mfu_device"] = str(device)
    report["mfu_peaks"] = peaks
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"torch {report['torch']} (CUDA {report['cuda']}, cuDNN {report['cudnn']}), "
          f"Python {report['python']}")
    memory = report["memory_bytes"]
    print(f"CPU: {report['cpu']}, {report['cpu_threads']} torch threads, "
          f"{memory / 2**30:.1f} GiB RAM" if memory else f"CPU: {report['cpu']}")
    for gpu in report["gpus"]:  # type: ignore[union-attr]
        print(f"GPU {gpu['index']}: {gpu['name']}, {gpu['memory_bytes'] / 2**30:.1f} GiB, "
              f"sm_{gpu['capability']}")
    if not torch.cuda.is_available():
        print("GPU: none visible")
    print(f"Peak FLOP/s used for MFU on {device}:")
    for key, peak in peaks.items():
        value = "unknown (MFU null)" if peak["flops"] is None else f"{peak['flops'] / 1e12:.3f} T"
        print(f"  {key}: {value}  [{peak['source']}]")
    return 0


def _who() -> str:
    """'rank R: ' inside a distributed job, so every error names the rank that raised it."""
    rank = os.environ.get("RANK")
    return f"rank {rank}: " if rank is not None and os.environ.get("WORLD_SIZE") else ""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    warnings.simplefilter("default", UserWarning)
    from gpuflow.parallel.launch import WorkerFailedError

    try:
        return int(args.handler(args, argv))
    except UserError as exc:
        print(f"gpuflow: {_who()}error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Preempted as exc:
        print(f"gpuflow: {_who()}{exc} Exit code {EXIT_PREEMPTED}: requeue the job.",
              file=sys.stderr)
        return EXIT_PREEMPTED
    except NonFiniteLossError as exc:
        print(f"gpuflow: {_who()}training diverged: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    except WorkerFailedError as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return EXIT_WORKER_FAILED
    except KeyboardInterrupt:
        print("gpuflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
