"""The GPU benchmark suite: one call on a lent GPU, under 8 minutes, one results file.

Stages, each under its own time limit and skipped when the suite's budget runs short (the
results file is rewritten after every stage, so a cut-off run still leaves what it measured):

1. matmul peak probe: the best bf16 ``torch.mm`` throughput, against the datasheet peak.
2. ``gpuflow train --workload textlm`` at 124m and 1b, bf16, ``--compile`` (per block),
   fused AdamW, synthetic data, several micro-batch sizes, with ``--strategy auto`` so that
   every summary records the planner's predicted memory and step time next to the measured
   ones. Targets on one H200 (dense bf16 peak 989 TFLOP/s): MFU >= 45% at 124m, >= 50% at 1b.
3. ``--batch-size auto`` on the device: the largest micro-batch found by real allocation,
   asked for a global batch that does not fit in one micro-batch, so the probe runs out
   of memory, recovers and accumulates.
4. the CUDA-only training paths: fp16 with loss scaling, and a resumed run.
5. ``benchmarks/serving.py --device cuda``: dynamic batching against batch size 1, also
   with ``--cuda-graphs``.
6. ``benchmarks/compare_trainers.py --device cuda``: gpuflow against a plain loop, Lightning
   Fabric and Accelerate (where the machine has them), interleaved on the GPU, whose steps
   vary far less than a shared CPU's. Target: gpuflow within 1% of the plain loop and the
   fastest framework, at no higher peak device memory.
7. FSDP on the device (one process, ``--compile``): its exposed communication, timed with
   events around the compute stream's waits for FSDP's streams, is measured and the step's
   breakdown adds up (the dry run, without compiling, checks the CPU's timing instead).

    python3 benchmarks/gpu_suite.py             # on the GPU machine
    python3 benchmarks/gpu_suite.py --dry-run   # the same stages on the CPU, small sizes (CI)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
MFU_TARGETS = {"124m": 0.45, "1b": 0.50}
STAGES = ("matmul", "train", "batch-auto", "fp16-resume", "serving", "compare", "fsdp-comm")


# The dry run's model: the stages' code paths at the smallest size (bf16 and fp16 are
# emulated, many times slower, on CPUs without native support).
DRY_MODEL = "layers=2,dim=64,heads=2,seq=64"
# fp16 steps before and after the resume: (run, resume to) on the GPU and in the dry run.
FP16_STEPS = {False: (40, 60), True: (6, 9)}


@dataclass(frozen=True)
class TrainRun:
    """One `gpuflow train` invocation of the suite."""

    label: str
    model_size: str
    global_batch: int
    steps: int
    log_every: int
    flags: tuple[str, ...] = ()


@dataclass
class Suite:
    dry_run: bool
    out: Path
    work: Path
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    result: dict[str, Any] = field(default_factory=dict)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def log(self, message: str) -> None:
        print(f"[gpu_suite +{time.monotonic() - self.started:5.0f}s] {message}", file=sys.stderr,
              flush=True)

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=2) + "\n")
        tmp.replace(self.out)

    def run(self, name: str, command: list[str], limit_s: float,
            env: dict[str, str] | None = None) -> tuple[int | None, str]:
        """Run a command under ``min(limit_s, time left)``; returns (exit code, log path)."""
        limit = min(limit_s, self.left_s())
        log_path = self.work / f"{name}.log"
        if limit < 20:
            log_path.write_text(f"skipped: {self.left_s():.0f} s of the budget left\n")
            return None, str(log_path)
        with log_path.open("w") as log:
            try:
                done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=limit, cwd=ROOT, env={**os.environ, **(env or {})})
                return done.returncode, str(log_path)
            except subprocess.TimeoutExpired:
                log.write(f"\n[gpu_suite] stopped after {limit:.0f} s\n")
                return None, str(log_path)


def tail(path: str, chars: int = 2000) -> str:
    text = Path(path).read_text(errors="replace")
    return text[-chars:]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_probe(device: torch.device, sizes: list[int]) -> dict[str, Any]:
    """Best of five timed groups of ten bf16 products per size, on random data."""
    best: dict[int, float] = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        torch.mm(a, b)
        sync(device)
        reps, fastest = 10, float("inf")
        for _ in range(5):
            begin = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b)
            sync(device)
            fastest = min(fastest, (time.perf_counter() - begin) / reps)
        best[n] = 2 * n**3 / fastest / 1e12
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device_name": name, "bf16_tflops_by_size": best,
            "bf16_tflops": max(best.values())}


def gpuflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpuflow.cli", *args]


def summarize_run(run: TrainRun, run_dir: Path) -> dict[str, Any]:
    s = json.loads((run_dir / "summary.json").read_text())
    median = s["median"]
    entry: dict[str, Any] = {
        "label": run.label, "model_size": run.model_size,
        "tokens_per_s": median.get("tokens_per_s"), "mfu": median.get("mfu"),
        "step_time_s": median.get("step_time_s"),
        "data_wait_frac": median.get("data_wait_frac"),
        "peak_flops": s["peak_flops"], "peak_flops_source": s["peak_flops_source"],
        "peak_mem_bytes": s["peak_mem_bytes"], "peak_mem_kind": s["peak_mem_kind"],
        "compiled": s["compiled"], "compile_scope": s.get("compile_scope"),
        "global_batch": s["global_batch"], "steps": s["steps"], "wall_time_s": s["wall_time_s"],
        "device_name": s["device_name"], "final_metrics": s["final_metrics"],
        "config": s["config"],
    }
    plan = (s.get("plan") or {}).get("predicted_vs_measured")
    if plan:
        entry["planner"] = {
            key: {"predicted": pair[0], "measured": pair[1],
                  "error": (pair[0] - pair[1]) / pair[1] if pair[0] and pair[1] else None}
            for key, pair in plan.items()}
    return entry


def train_stage(suite: Suite, runs: list[TrainRun], device: str, limit_s: float) -> None:
    results: list[dict[str, Any]] = []
    suite.result["train"] = results
    for run in runs:
        run_dir = suite.work / f"textlm-{run.label}"
        suite.log(f"train textlm {run.label}")
        code, log = suite.run(f"train-{run.label}", gpuflow(
            "train", "--workload", "textlm", "--data", "synthetic",
            "--model-size", run.model_size, "--device", device, "--precision", "bf16",
            "--strategy", "auto", "--global-batch", str(run.global_batch),
            "--max-steps", str(run.steps), "--log-every", str(run.log_every),
            "--warmup-steps", "5", "--eval-every", "0", "--no-checkpoints", "--no-progress",
            "--run-dir", str(run_dir), *run.flags), limit_s)
        if code == 0 and (run_dir / "summary.json").is_file():
            entry = summarize_run(run, run_dir)
        else:
            entry = {"label": run.label, "model_size": run.model_size, "exit_code": code,
                     "error": tail(log)}
        results.append(entry)
        suite.save()
    best: dict[str, dict[str, Any]] = {}
    for entry in results:
        if entry.get("mfu") is not None and (entry["model_size"] not in best or
                                             entry["mfu"] > best[entry["model_size"]]["mfu"]):
            best[entry["model_size"]] = entry
    for size, entry in best.items():
        if size in MFU_TARGETS:
            entry["target"] = {"mfu_min": MFU_TARGETS[size],
                               "met": entry["mfu"] >= MFU_TARGETS[size]}


def batch_size_auto_stage(suite: Suite, device: str, size: str, global_batch: int) -> None:
    run_dir = suite.work / "batch-auto"
    suite.log(f"--batch-size auto, textlm {size}")
    code, log = suite.run("batch-auto", gpuflow(
        "train", "--workload", "textlm", "--data", "synthetic", "--model-size", size,
        "--device", device, "--precision", "bf16", "--batch-size", "auto",
        "--global-batch", str(global_batch), "--max-steps", "3", "--log-every", "1",
        "--eval-every", "0", "--no-checkpoints", "--no-progress", "--run-dir", str(run_dir)),
        120)
    entry: dict[str, Any] = {"model_size": size, "global_batch": global_batch, "exit_code": code}
    if code == 0:
        s = json.loads((run_dir / "summary.json").read_text())
        entry.update({"probe": s["plan"]["batch_size_auto"], "peak_mem_bytes": s["peak_mem_bytes"],
                      "device_memory_bytes": s["device_memory_bytes"], "steps": s["steps"]})
    else:
        entry["error"] = tail(log)
    suite.result["batch_size_auto"] = entry
    suite.save()


def paths_stage(suite: Suite, device: str) -> None:
    """fp16 with a GradScaler, then a resume from its checkpoint: the device-specific paths."""
    run_dir = suite.work / "digits-fp16"
    suite.log("digits fp16 + resume")
    steps, resumed_to = FP16_STEPS[suite.dry_run]
    common = ["--workload", "digits", "--device", device, "--precision", "fp16",
              "--eval-every", "0", "--no-progress", "--run-dir", str(run_dir)]
    first, log1 = suite.run("fp16", gpuflow("train", *common, "--max-steps", str(steps),
                                             "--checkpoint-every", str(steps // 2)), 90)
    second, log2 = suite.run("fp16-resume", gpuflow("train", *common, "--max-steps",
                                                    str(resumed_to), "--resume"), 90)
    entry: dict[str, Any] = {"exit_codes": [first, second], "resumed_to": resumed_to}
    if first == 0 and second == 0:
        s = json.loads((run_dir / "summary.json").read_text())
        entry.update({"steps": s["steps"], "skipped_steps": s["skipped_steps"],
                      "final_metrics": s["final_metrics"]})
    else:
        entry["error"] = tail(log1 if first else log2)
    suite.result["fp16_resume"] = entry
    suite.save()


def serving_stage(suite: Suite, device: str, name: str, *extra: str) -> None:
    serving_json = suite.work / f"{name}.json"
    suite.log(f"serving benchmark {' '.join(extra)}")
    flags = (["--quick"] if suite.dry_run else
             ["--workload", "textlm", "--rounds", "2", "--warmup-s", "2", "--window-s", "5"])
    code, log = suite.run(name, [sys.executable, "benchmarks/serving.py", "--device", device,
                                 *flags, *extra, "--out", str(serving_json)], 150)
    suite.result[name] = (json.loads(serving_json.read_text()) if code == 0
                          else {"exit_code": code, "error": tail(log)})
    suite.save()


def compare_stage(suite: Suite, device: str) -> None:
    compare_json = suite.work / "compare_trainers.json"
    suite.log("compare_trainers")
    flags = (["--models", "linear", "--rounds", "2", "--warmup-rounds", "1",
              "--round-seconds", "0.02", "--memory-repeats", "1"] if suite.dry_run
             else ["--rounds", "10"])
    code, log = suite.run("compare_trainers", [sys.executable, "benchmarks/compare_trainers.py",
                                               "--device", device, *flags,
                                               "--out", str(compare_json)], 200)
    if code != 0:
        suite.result["compare_trainers"] = {"exit_code": code, "error": tail(log)}
    else:
        result = json.loads(compare_json.read_text())
        suite.result["compare_trainers"] = {
            "skipped": result["skipped"], "table": result["table"],
            "verdicts": result["verdicts"],
            "cases": [{key: case[key] for key in ("model", "precision", "median_step_ms",
                                                  "vs_plain", "memory", "target")}
                      for case in result["cases"]]}
    suite.save()


def fsdp_comm_stage(suite: Suite, device: str, size: str) -> None:
    """FSDP's exposed communication on the device: measured, and the parts add up."""
    run_dir = suite.work / "fsdp-comm"
    suite.log(f"fsdp exposed communication, textlm {size}")
    code, log = suite.run("fsdp-comm", gpuflow(
        "train", "--workload", "textlm", "--data", "synthetic", "--model-size", size,
        "--device", device, "--precision", "bf16", "--strategy", "fsdp",
        *([] if suite.dry_run else ["--compile"]), "--batch-size", "8", "--max-steps", "12",
        "--log-every", "3", "--warmup-steps", "2",
        "--eval-every", "0", "--no-checkpoints", "--no-progress", "--run-dir", str(run_dir)),
        120)
    entry: dict[str, Any] = {"model_size": size, "exit_code": code}
    if code == 0:
        records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                   if "event" not in r]
        parts = ("data_wait_s", "compute_s", "comm_s", "optimizer_s", "host_s")
        entry.update({
            "comm_s": [r["comm_s"] for r in records],
            "comm_frac": [r["comm_frac"] for r in records],
            "step_time_s": [r["step_time_s"] for r in records],
            "measured": all(r["comm_s"] is not None for r in records),
            "parts_add_up": all(r["comm_s"] is not None and abs(
                sum(r[k] for k in parts) - r["step_time_s"]) <= 1e-6 * r["step_time_s"]
                for r in records)})
    else:
        entry["error"] = tail(log)
    suite.result["fsdp_comm"] = entry
    suite.save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="the same stages on the CPU at small sizes (checks the script)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default benchmarks/results/gpu_suite-<host>.json")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: temp)")
    parser.add_argument("--budget-s", type=float, default=450,
                        help="stop starting stages when this much time has passed (default 450)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated subset of {','.join(STAGES)} (default all)")
    parser.add_argument("--runs", default=None,
                        help="comma-separated training run labels, e.g. 124m-b64 (default all)")
    args = parser.parse_args()
    stages = set(args.stages.split(","))
    if stages - set(STAGES):
        parser.error(f"unknown stage(s) {sorted(stages - set(STAGES))}; choose from {STAGES}")
    host = socket.gethostname().split(".")[0]
    out = args.out or ROOT / "benchmarks" / "results" / f"gpu_suite-{host}.json"
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpuflow-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GPUFLOW_CACHE_DIR", str(work / "cache"))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    suite = Suite(args.dry_run, out, work, args.budget_s)
    if args.dry_run:
        device = "cpu"
        runs = [TrainRun("small-b4", DRY_MODEL, 4, 6, 2)]
        matmul_sizes = [256]
    else:
        device = "cuda"
        # The configurations the targets name come first, so a short lease still measures them.
        runs = [TrainRun("124m-b32", "124m", 32, 60, 10, ("--compile",)),
                TrainRun("1b-b16", "1b", 16, 25, 5, ("--compile",)),
                TrainRun("124m-b64", "124m", 64, 50, 10, ("--compile",)),
                TrainRun("124m-b128", "124m", 128, 40, 8, ("--compile",)),
                TrainRun("1b-b8", "1b", 8, 30, 5, ("--compile",))]
        matmul_sizes = [4096, 8192, 16384]
    if args.runs:
        runs = [run for run in runs if run.label in args.runs.split(",")]
    suite.result = {
        "benchmark": "gpu_suite",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "python3 benchmarks/gpu_suite.py" + (" --dry-run" if args.dry_run else ""),
        "dry_run": args.dry_run,
        "machine": {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    "nvidia_smi": shutil.which("nvidia-smi") and subprocess.run(
                        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                         "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()},
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()},
    }
    if "matmul" in stages:
        suite.log(f"matmul peak probe on {device}")
        suite.result["matmul"] = matmul_probe(torch.device(device), matmul_sizes)
        suite.save()
    if "train" in stages:
        train_stage(suite, runs, device, limit_s=300 if args.dry_run else 150)
    if "batch-auto" in stages:
        batch_size_auto_stage(suite, device, DRY_MODEL if args.dry_run else "124m",
                              8 if args.dry_run else 1024)
    if "fp16-resume" in stages:
        paths_stage(suite, device)
    if "serving" in stages:
        serving_stage(suite, device, "serving")
        if device == "cuda":
            serving_stage(suite, device, "serving_cuda_graphs", "--cuda-graphs")
    if "compare" in stages:
        compare_stage(suite, device)
    if "fsdp-comm" in stages:
        fsdp_comm_stage(suite, device, DRY_MODEL if args.dry_run else "124m")
    suite.result["wall_time_s"] = time.monotonic() - suite.started
    suite.save()
    for entry in suite.result.get("train", []):
        if "error" in entry:
            print(f"textlm {entry['label']}: FAILED (exit {entry['exit_code']})")
            continue
        mfu = "n/a" if entry["mfu"] is None else f"{100 * entry['mfu']:.1f}%"
        target = entry.get("target")
        verdict = "" if not target else (
            f"  target >= {100 * target['mfu_min']:.0f}%: {'met' if target['met'] else 'NOT met'}")
        peak = entry["peak_mem_bytes"]
        print(f"textlm {entry['label']}: {entry['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
              f"step {entry['step_time_s']:.4f} s, peak "
              + ("n/a" if peak is None else f"{peak / 2**30:.1f} GiB") + verdict)
    for name in ("serving", "serving_cuda_graphs"):
        runs_of = suite.result.get(name, {}).get("runs")
        if runs_of:
            print(f"{name}: " + ", ".join(f"{config} {figures['requests_per_s']:.1f} req/s"
                                          for config, figures in runs_of.items()))
    for verdict in suite.result.get("compare_trainers", {}).get("verdicts", []):
        print(f"compare_trainers {verdict}")
    if "matmul" in suite.result:
        print(f"matmul bf16: {suite.result['matmul']['bf16_tflops']:.1f} TFLOP/s")
    print(f"wall {suite.result['wall_time_s']:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
