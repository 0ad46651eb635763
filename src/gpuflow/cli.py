"""The `gpuflow` command: parses flags and hands over; no training logic lives here."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuflow.errors import NonFiniteLossError, UserError

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3


def _positive_or_none(text: str) -> float | None:
    return None if text.lower() in ("none", "off", "0") else float(text)


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--config", help="TOML file with the same fields as the flags (flags override it)")
    add("--workload", help="built-in name (digits) or pkg.module:factory returning a Workload")
    add("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    add("--precision", choices=["fp32", "tf32", "bf16", "fp16"], help="default fp32")
    add("--batch-size", type=int, help="samples per micro-batch (default 64)")
    add("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    add("--lr", type=float, help="peak learning rate (default 3e-3)")
    add("--optimizer", choices=["adamw", "sgd"], help="default adamw")
    add("--weight-decay", type=float, help="on weight matrices only (default 0.01)")
    add("--schedule", choices=["cosine", "constant"], help="after warmup (default cosine)")
    add("--warmup-steps", type=int, help="linear warmup steps (default 20)")
    add("--max-steps", type=int, help="optimizer steps to run")
    add("--epochs", type=float, help="passes over the training set (default 10 if no --max-steps)")
    add("--eval-every", type=int, help="evaluate every N steps, 0 = only at the end (default 100)")
    add("--log-every", type=int, help="write a metrics record every N steps (default 10)")
    add("--compile", action="store_true", default=argparse.SUPPRESS, help="torch.compile")
    add("--activation-checkpointing", action="store_true", default=argparse.SUPPRESS,
        help="recompute the workload's repeated blocks in backward")
    add("--clip-grad", type=_positive_or_none, help="max gradient norm (default off)")
    add("--seed", type=int, help="default 0")
    add("--run-dir", help="default runs/<workload>-<timestamp>")
    add("--checkpoint-every", type=int, help="save every N steps (default 0: at the end only)")
    add("--keep-checkpoints", type=int, help="newest checkpoints to keep (default 3)")
    add("--resume", nargs="?", const=True,
        help="continue from the newest valid checkpoint of --run-dir, or of the given DIR")
    add("--num-workers", type=int, help="DataLoader worker processes (default 0)")
    add("--max-nonfinite-steps", type=int,
        help="stop after this many consecutive NaN/inf losses (default 20)")
    add("--tensorboard", action="store_true", default=argparse.SUPPRESS,
        help="also write TensorBoard event files (needs gpuflow[tensorboard])")
    add("--no-progress", dest="progress", action="store_false", default=argparse.SUPPRESS,
        help="no live progress output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuflow", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a workload",
                                argument_default=argparse.SUPPRESS)
    _add_train_flags(train)
    env = commands.add_parser("env", help="devices, versions and the peak FLOP/s used for MFU")
    env.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _train(args: argparse.Namespace) -> int:
    from gpuflow.config import build_config, load_toml
    from gpuflow.train.loop import seed_everything, train
    from gpuflow.train.progress import print_summary
    from gpuflow.workload import resolve_workload

    flags: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
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
    seed_everything(config.seed)
    workload = resolve_workload(config.workload)
    result = train(workload, config)
    print_summary(result.summary)
    return 0


def _saved_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.json"
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"--resume: {run_dir} is not a gpuflow run dir (no config.json).") from None
    saved.pop("extra", None)
    saved.pop("resume", None)
    return saved


def _env(args: argparse.Namespace) -> int:
    import torch

    from gpuflow.hardware import environment_report, peak_flops, resolve_device

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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.simplefilter("default", UserWarning)
    try:
        if args.command == "train":
            return _train(args)
        return _env(args)
    except UserError as exc:
        print(f"gpuflow: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except NonFiniteLossError as exc:
        print(f"gpuflow: training diverged: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    except KeyboardInterrupt:
        print("gpuflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
