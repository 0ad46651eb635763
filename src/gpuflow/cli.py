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

from gpuflow.errors import NonFiniteLossError, UserError

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_WORKER_FAILED = 1


def _int_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def _positive_or_none(text: str) -> float | None:
    return None if text.lower() in ("none", "off", "0") else float(text)


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--config", help="TOML file with the same fields as the flags (flags override it)")
    add("--workload", help="built-in name (digits, mnist-idx, textlm, speech) or "
                            "pkg.module:factory returning a Workload")
    add("--data-dir", help="the workload's data (a folder; each workload says what it reads)")
    add("--data", choices=["real", "synthetic"],
        help="synthetic: random data of the workload's shapes, for throughput runs")
    add("--model-size", help="the workload's model size preset (e.g. textlm: tiny|small|124m)")
    add("--val-speakers", metavar="NAMES",
        help="speech: speakers held out for validation, comma-separated (default: the last "
             "by name); none: takes 0-4 of every speaker")
    add("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    add("--precision", choices=["fp32", "tf32", "bf16", "fp16", "fp8"],
        help="default fp32; fp8: torchao float8 matmuls in the linear layers that gain, bf16 "
             "autocast elsewhere (H100-class GPUs, turns on --compile, needs gpuflow[fp8])")
    add("--fp8-recipe", choices=["tensorwise", "rowwise"],
        help="--precision fp8 scaling: one scale per tensor (default; fp8 all-gather under "
             "fsdp) or per row (more accurate, a little slower)")
    add("--batch-size", type=_int_or_auto,
        help="samples per micro-batch (default 64), or auto: the largest that fits, "
             "accumulating to keep the global batch")
    add("--global-batch", type=int,
        help="samples per optimizer step over all ranks (with --batch-size auto)")
    add("--memory-cap-gib", type=float,
        help="--batch-size auto: memory the step may use per device (default: the GPU's "
             "free memory; on a CPU 90%% of RAM)")
    add("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    add("--lr", type=float, help="peak learning rate (default 3e-3)")
    add("--optimizer", choices=["adamw", "sgd"], help="default adamw")
    add("--weight-decay", type=float, help="on weight matrices only (default 0.01)")
    add("--schedule", choices=["cosine", "constant"], help="after warmup (default cosine)")
    add("--warmup-steps", type=int, help="linear warmup steps (default 20)")
    add("--max-steps", type=int, help="optimizer steps to run")
    add("--epochs", type=float, help="passes over the training set (default 10 if no --max-steps)")
    add("--eval-every", type=int, help="evaluate every N steps, 0 = only at the end (default 100)")
    add("--eval-batches", type=int,
        help="validation batches per evaluation: a fixed subset spread over the set, the "
             "same each time (default 20; a smaller set is evaluated whole; 0: always whole)")
    add("--log-every", type=int, help="write a metrics record every N steps (default 10)")
    add("--compile", action="store_true", default=argparse.SUPPRESS, help="torch.compile")
    add("--activation-checkpointing", action="store_true", default=argparse.SUPPRESS,
        help="recompute the workload's repeated blocks in backward")
    add("--clip-grad", type=_positive_or_none, help="max gradient norm (default off)")
    add("--cuda-graphs", action="store_true", default=argparse.SUPPRESS,
        help="replay each step's forward and backward as CUDA graphs (torch.compile "
             "reduce-overhead): for launch-bound, static-shape runs on one GPU")
    add("--seed", type=int, help="default 0")
    add("--run-dir", help="default runs/<workload>-<timestamp>")
    add("--checkpoint-every", type=int, help="save every N steps (default 0: at the end only)")
    add("--keep-checkpoints", type=int, help="newest checkpoints to keep (default 3)")
    add("--no-checkpoints", dest="save_checkpoints", action="store_false",
        default=argparse.SUPPRESS,
        help="write no checkpoint, not even the final one (benchmarks, throwaway runs)")
    add("--resume", nargs="?", const=True,
        help="continue from the newest valid checkpoint of --run-dir, or of the given DIR")
    add("--num-workers", type=int, help="DataLoader worker processes (default 0)")
    add("--max-nonfinite-steps", type=int,
        help="stop after this many consecutive NaN/inf losses (default 20)")
    add("--tensorboard", action="store_true", default=argparse.SUPPRESS,
        help="also write TensorBoard event files (needs gpuflow[tensorboard])")
    add("--no-progress", dest="progress", action="store_false", default=argparse.SUPPRESS,
        help="no live progress output")
    dist = parser.add_argument_group("distributed (torch.distributed, elastic launcher)")
    dist.add_argument("--strategy", choices=["single", "ddp", "fsdp", "tp", "pp", "auto"],
                      help="default: single for one process, ddp for several; auto: the "
                           "planner's best plan for the devices present")
    dist.add_argument("--tp", type=int,
                      help="tensor-parallel degree (tp: all processes; fsdp: FSDP x TP mesh)")
    dist.add_argument("--pp", type=int,
                      help="pipeline stages (pp: all processes; fsdp: FSDP x PP mesh)")
    dist.add_argument("--dp", type=int,
                      help="data-parallel degree, checked: dp x tp x pp = processes")
    dist.add_argument("--pp-schedule", choices=["gpipe", "1f1b", "interleaved-1f1b"],
                      help="pipeline schedule (default 1f1b; interleaved: 2 stages per rank)")
    dist.add_argument("--pp-split", choices=["auto", "trace", "manual"],
                      help="how the model is cut into stages: traced with torch.export, or "
                           "manual: module copies cut at the repeated blocks (auto, the "
                           "default: traced, manual when tracing fails)")
    dist.add_argument("--microbatches", type=int,
                      help="pipeline micro-batches per --batch-size batch (default 2 x pp)")
    dist.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction,
                      help="fsdp: free gathered params after forward (ZeRO-3-like, default) "
                           "or keep them for backward (ZeRO-2-like)")
    dist.add_argument("--fsdp-wrap", choices=["block", "model"],
                      help="fsdp's unit of gathering: each repeated block (default), or the "
                           "whole model at once: two collectives per step instead of three per "
                           "block, for links or CPUs that cannot overlap them with compute")
    dist.add_argument("--fsdp-prefetch", type=int, metavar="N",
                      help="fsdp per block: each block's forward starts the all-gathers of the "
                           "next N blocks, its backward those of the N before it, whether or "
                           "not the host runs ahead (default: FSDP's own, one block ahead "
                           "when the host is ahead); holds N more blocks gathered")
    dist.add_argument("--bucket-mb", type=float,
                      help="ddp: gradient bucket size in MiB (default PyTorch's: 1 for the "
                           "first, 25 after); smaller buckets start all-reducing earlier in "
                           "backward and leave less to finish after it, larger ones make "
                           "fewer calls")
    dist.add_argument("--nproc", type=int, help="worker processes on this node (default 1)")
    dist.add_argument("--nnodes", type=int, help="nodes in the job (default 1)")
    dist.add_argument("--node-rank", type=int, help="this node's rank; node 0 hosts rendezvous")
    dist.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (multi-node)")
    dist.add_argument("--max-restarts", type=int,
                      help="restart failed workers this often, resuming from the last checkpoint")


# Subcommands that live in their own module under gpuflow.commands: each module has
# `register(commands)`, which adds its parser and sets `handler(args, argv) -> exit code`.
_COMMAND_MODULES: tuple[str, ...] = ("report", "data", "serve", "predict", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuflow", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a workload",
                                argument_default=argparse.SUPPRESS)
    _add_train_flags(train)
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
    from gpuflow.train.loop import seed_everything, train
    from gpuflow.train.progress import print_summary
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
    workload = resolve_workload(config.workload, config.workload_options())
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
    from gpuflow.train.loop import default_run_dir

    run_dir = config.run_dir or str(default_run_dir(config.workload))
    spec = LaunchSpec(config.nproc, config.nnodes, config.node_rank, config.rdzv_endpoint,
                      config.max_restarts)
    launch(spec, [*argv, "--run-dir", run_dir])
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

    path, step = export_model(Path(args.run_dir), Path(args.out), args.format)
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
