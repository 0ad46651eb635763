"""Is the input pipeline ever the bottleneck? data_wait_frac from raw and from packed data.

For each built-in workload whose data is present, the raw set is packed once with
``gpuflow data pack``; then ``gpuflow train`` runs a short job from the raw data and from the
packed set, with ``--num-workers`` 0 (the default) and 2, as a user runs it (a subprocess).
The figure is the median ``data_wait_frac`` of the run's logged windows (``summary.json``):
the share of each step spent waiting for its batch. Beside it, the loader alone: the
samples/s of the very batch stream the trainer builds, drawn with no training, against the
training step's samples/s. The target is at most 0.02 at the default worker count; runs
with 2 workers are reported too (on 2 cores their processes compete with the step).

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
DEFAULT_WORKERS = 0
LOADER_BATCHES = 60
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


def loader_rate(workload: str, data_dir: Path | None, flags: list[str], workers: int) -> float:
    """Samples/s of the training batch stream alone (the trainer's own loader set-up)."""
    import time

    from gpuflow.data.loader import supports_batched_indexing, train_batches
    from gpuflow.workload import resolve_workload

    options: dict[str, Any] = {} if data_dir is None else {"data_dir": str(data_dir)}
    if "--model-size" in flags:
        options["model_size"] = flags[flags.index("--model-size") + 1]
    batch_size = int(flags[flags.index("--batch-size") + 1])
    loaded = resolve_workload(workload, options)
    batches = train_batches(
        loaded.train_dataset, batch_size, loaded.collate, seed=0, start_batch=0,
        num_workers=workers, pin_memory=False,
        batched_indexing=supports_batched_indexing(loaded.train_dataset, loaded.collate_fn))
    for _ in range(5):  # workers started, first shards opened and verified
        next(batches)
    start = time.perf_counter()
    for _ in range(LOADER_BATCHES):
        next(batches)
    return LOADER_BATCHES * batch_size / (time.perf_counter() - start)


def bench_workload(workload: str, src: Path | None, flags: list[str], steps: int,
                   workdir: Path) -> dict[str, Any]:
    packed = workdir / f"{workload}-packed"
    gpuflow("data", "pack", *([str(src)] if src else []), "--out", str(packed),
            "--workload", workload, "--no-progress", log=workdir / f"{workload}-pack.log")
    runs: dict[str, Any] = {}
    for source, data_dir in (("raw", src), ("packed", packed)):
        for workers in WORKERS:
            name = f"{source}/workers={workers}"
            run = train_run(workload, data_dir, flags, workers, steps,
                            workdir / f"{workload}-{source}-{workers}")
            run["loader_samples_per_s"] = loader_rate(workload, data_dir, flags, workers)
            runs[name] = run
            print(f"  {workload:10s} {name:18s} data_wait_frac {run['data_wait_frac']:.4f}  "
                  f"step {1e3 * run['step_time_s']:.1f} ms  training "
                  f"{run['samples_per_s']:,.0f} samples/s, loader alone "
                  f"{run['loader_samples_per_s']:,.0f}", flush=True)
    worst = max(run["data_wait_frac"] for name, run in runs.items()
                if name.endswith(f"workers={DEFAULT_WORKERS}"))
    return {"data_dir": str(src) if src else None, "train_flags": flags, "runs": runs,
            "worst_data_wait_frac_default_workers": worst, "meets_target": worst <= TARGET}


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
        **_common.provenance(),
        "machine": _common.machine_info(),
        "target_data_wait_frac": TARGET,
        "target_judged_at_workers": DEFAULT_WORKERS,
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
