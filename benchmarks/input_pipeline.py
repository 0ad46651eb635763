"""Is the input pipeline ever the bottleneck? data_wait_frac from raw and from packed data.

For each built-in workload whose data is present, the raw set is packed once with
``gpuflow data pack``; then ``gpuflow train`` runs a short job from the raw data and from the
packed set, with ``--num-workers`` 0 and 2, as a user runs it (a subprocess). The figure is
the median ``data_wait_frac`` of the run's logged windows (``summary.json``): the share of
each step spent waiting for its batch. The target is at most 0.02 everywhere.

Run: ``python benchmarks/input_pipeline.py`` (about 10 minutes on 2 cores); ``--steps`` and
``--workloads`` shorten it. Writes ``benchmarks/results/input_pipeline-<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402

TARGET = 0.02
FSDD = HERE.parent.parent / "shared" / "data" / "fsdd" / "recordings"
MNIST = Path("/usr/share/datasets/fashion-mnist")
# workload -> (raw --data-dir or None for the bundled default, extra train flags)
WORKLOADS: dict[str, tuple[Path | None, list[str]]] = {
    "digits": (None, ["--batch-size", "64"]),
    "mnist-idx": (MNIST, ["--batch-size", "64"]),
    "textlm": (None, ["--batch-size", "16", "--model-size", "tiny"]),
    "speech": (FSDD, ["--batch-size", "32", "--model-size", "tiny"]),
}
WORKERS = (0, 2)


def gpuflow(*args: str, log: Path) -> None:
    """Run the CLI; a failure stops the benchmark with the run's output."""
    with open(log, "w") as handle:
        code = subprocess.run([sys.executable, "-m", "gpuflow.cli", *args],
                              stdout=handle, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"`gpuflow {' '.join(args)}` failed ({code}):\n{log.read_text()[-3000:]}")


def train_run(workload: str, data_dir: Path | None, flags: list[str], workers: int,
              steps: int, run_dir: Path) -> dict[str, Any]:
    data = [] if data_dir is None else ["--data-dir", str(data_dir)]
    gpuflow("train", "--workload", workload, *data, *flags, "--max-steps", str(steps),
            "--num-workers", str(workers), "--eval-every", "0", "--log-every", "5",
            "--no-progress", "--run-dir", str(run_dir), log=run_dir.with_suffix(".log"))
    median = json.loads((run_dir / "summary.json").read_text())["median"]
    return {key: median.get(key) for key in
            ("data_wait_frac", "data_wait_s", "step_time_s", "samples_per_s")}


def bench_workload(workload: str, src: Path | None, flags: list[str], steps: int,
                   workdir: Path) -> dict[str, Any]:
    packed = workdir / f"{workload}-packed"
    gpuflow("data", "pack", *([str(src)] if src else []), "--out", str(packed),
            "--workload", workload, "--no-progress", log=workdir / f"{workload}-pack.log")
    runs: dict[str, Any] = {}
    for source, data_dir in (("raw", src), ("packed", packed)):
        for workers in WORKERS:
            name = f"{source}/workers={workers}"
            runs[name] = train_run(workload, data_dir, flags, workers, steps,
                                   workdir / f"{workload}-{source}-{workers}")
            print(f"  {workload:10s} {name:18s} data_wait_frac "
                  f"{runs[name]['data_wait_frac']:.4f}  step "
                  f"{1e3 * runs[name]['step_time_s']:.1f} ms", flush=True)
    worst = max(run["data_wait_frac"] for run in runs.values())
    return {"data_dir": str(src) if src else None, "train_flags": flags, "runs": runs,
            "worst_data_wait_frac": worst, "meets_target": worst <= TARGET}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=_common.default_result_path("input_pipeline"))
    args = parser.parse_args()

    load = _common.ForeignLoad(include_children=True)
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="gpuflow-input-") as tmp:
        for workload in args.workloads:
            src, flags = WORKLOADS[workload]
            if src is not None and not src.is_dir():
                skipped[workload] = f"no data at {src}"
                continue
            results[workload] = bench_workload(workload, src, flags, args.steps, Path(tmp))
    foreign = load.share()
    payload = {
        "benchmark": "input_pipeline",
        "timestamp": _common.timestamp(),
        "command": _common.command_line(),
        "machine": _common.machine_info(),
        "versions": _common.versions(),
        "target_data_wait_frac": TARGET,
        "steps_per_run": args.steps,
        "foreign_cpu_share": foreign,
        "all_meet_target": all(r["meets_target"] for r in results.values()),
        "workloads": results,
        "skipped": skipped,
    }
    _common.write_json(args.out, payload)
    share = "unknown" if foreign is None else f"{100 * foreign:.0f}%"
    print(f"other processes used {share} of the CPUs meanwhile; wrote {args.out}")


if __name__ == "__main__":
    main()
