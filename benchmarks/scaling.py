"""Data-parallel scaling on this machine's CPUs: 1 process vs N processes, one thread each.

``gpuflow train`` is run as a user runs it (a subprocess of ``python -m gpuflow.cli``) on a
compute-heavy workload (``benchmarks/scaling_workload.py``), once as a single one-thread
process and once as N ranks (``--nproc N``, the launcher gives each rank cores // N threads)
for ddp, for fsdp per block and for fsdp as one unit (``--fsdp-wrap model``). The per-rank
micro-batch is the same (weak scaling), so N ranks should reach N times the throughput; the
scaling efficiency is

    efficiency = throughput(N ranks) / (N x throughput(1 process)).

Throughput is the median of the logged windows' whole-job samples/s after the warm-up
windows. The configurations run interleaved in rounds, in a rotating order, so machine
drift hits all alike; each round gives an efficiency against that round's single run. A
control runs N independent single processes at once (no communication): its efficiency is
the most this machine's cores allow, so the gap between it and ddp/fsdp is what
communication and synchronisation cost. ``benchmarks/lockstep.py`` splits off the second:
what ranks that synchronise at every block (as FSDP's do) pay with nothing to communicate.

Run: ``python benchmarks/scaling.py`` (about 15 minutes on 2 cores), or ``--quick`` (under a
minute; no control).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402

WORKLOAD = "scaling_workload:build"
TARGET = 0.90
FOREIGN_LOAD_WARN = 0.05
# The parallel configurations and their `gpuflow train` flags; fsdp-zero2 keeps gathered
# parameters from forward to backward (one all-gather per block per step instead of two);
# fsdp-model shards the model as one unit (one all-gather and one reduction per step);
# ddp-bucket1 all-reduces 1 MiB buckets, which `gpuflow report` suggests for this model's
# 8 MiB of gradients (PyTorch's 25 MiB buckets hold them in two: 1 MiB, then the rest).
PARALLEL = {
    "ddp": ["--strategy", "ddp"],
    "ddp-bucket1": ["--strategy", "ddp", "--bucket-mb", "1"],
    "fsdp": ["--strategy", "fsdp"],
    "fsdp-zero2": ["--strategy", "fsdp", "--no-reshard-after-forward"],
    "fsdp-model": ["--strategy", "fsdp", "--fsdp-wrap", "model"],
}
DEFAULT_STRATEGIES = ("ddp", "ddp-bucket1", "fsdp", "fsdp-model")
CONTROL = "independent"
# comm_s is communication nothing overlapped: DDP's all-reduce left after backward, FSDP's
# collectives (they hold the host on the CPU); absent from gpuflow versions without it.
PER_STEP = ("step_time_s", "compute_s", "comm_s", "optimizer_s", "data_wait_s", "host_s")
RUN_TIMEOUT_S = 900


@dataclass(frozen=True)
class Settings:
    """What every run of one benchmark invocation shares."""

    nproc: int
    batch_size: int
    steps: int
    log_every: int
    skip_windows: int


def cli_command(flags: list[str], nproc: int, settings: Settings, run_dir: Path
                ) -> list[str]:
    """The exact `gpuflow train` command line a user would type for this configuration."""
    command = [sys.executable, "-m", "gpuflow.cli", "train", "--workload", WORKLOAD,
               "--batch-size", str(settings.batch_size), "--max-steps", str(settings.steps),
               "--log-every", str(settings.log_every), "--eval-every", "0", "--no-progress",
               *flags, "--run-dir", str(run_dir)]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    return command


def cli_env(single_thread: bool) -> dict[str, str]:
    """The workload module on PYTHONPATH; one thread for the single-process baseline.

    The single-process path leaves torch's thread count alone, so OMP_NUM_THREADS sets it;
    launched ranks get cores // nproc threads from gpuflow itself.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    if single_thread:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    return env


def threads_used(summary: dict[str, Any]) -> int | None:
    """Torch threads rank 0 trained with: the CPU peak probe names them in its source."""
    found = re.search(r"with (\d+) thread", summary.get("peak_flops_source") or "")
    return int(found.group(1)) if found else None


def read_run(run_dir: Path, skip_windows: int) -> dict[str, Any]:
    """Steady-state figures of one finished run from its metrics.jsonl and summary.json."""
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    windows = [r for r in map(json.loads, filter(None, lines)) if "event" not in r]
    # Keep at least one window, so a very short (smoke) run still yields a figure.
    steady = windows[min(skip_windows, max(0, len(windows) - 1)):]
    return {
        "world_size": summary["world_size"],
        "strategy": summary["strategy"],
        "global_batch": summary["global_batch"],
        "torch_threads": threads_used(summary),
        "steps": summary["steps"],
        "windows": len(windows),
        "windows_used": len(steady),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
        "window_samples_per_s": [r["samples_per_s"] for r in windows],
        "summary_median_samples_per_s": summary["median"]["samples_per_s"],
        "median_ms": {key.removesuffix("_s"): median_ms(steady, key) for key in PER_STEP},
    }


def median_ms(records: list[dict[str, Any]], key: str) -> float | None:
    """Median of a per-step field in milliseconds; None where no record has it."""
    values = [r[key] for r in records if r.get(key) is not None]
    return 1e3 * statistics.median(values) if values else None


def fail(name: str, log: Path, returncode: int) -> None:
    tail = log.read_text()[-4000:] if log.exists() else ""
    raise SystemExit(f"error: the {name} run failed (exit {returncode}); its output ends:\n"
                     f"{tail}")


def run_config(name: str, settings: Settings, workdir: Path, round_index: int
               ) -> dict[str, Any]:
    """Train one configuration to the end through the CLI and read back its throughput.

    The control starts N single-process runs together and adds their throughputs.
    """
    if name in PARALLEL:
        flags, nproc, copies = PARALLEL[name], settings.nproc, 1
    else:
        flags, nproc = ["--strategy", "single"], 1
        copies = settings.nproc if name == CONTROL else 1
    base = workdir / f"round{round_index}-{name}"
    run_dirs = [base] if copies == 1 else [base / f"proc{i}" for i in range(copies)]
    commands = [cli_command(flags, nproc, settings, run_dir) for run_dir in run_dirs]
    env = cli_env(single_thread=nproc == 1)
    foreign = _common.ForeignLoad(include_children=True)
    started = time.perf_counter()
    procs = []
    for run_dir, command in zip(run_dirs, commands, strict=True):
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        log = run_dir.parent / f"{run_dir.name}.log"
        with log.open("w") as handle:
            procs.append((subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                           env=env, cwd=HERE.parent), log))
    for proc, log in procs:
        try:
            returncode = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        if returncode != 0:
            for other, _ in procs:
                other.kill()
                other.wait()
            if returncode is None:
                raise SystemExit(f"error: the {name} run took over {RUN_TIMEOUT_S} s")
            fail(name, log, returncode)
    wall = time.perf_counter() - started
    parts = [read_run(run_dir, settings.skip_windows) for run_dir in run_dirs]
    first = parts[0]
    return {
        "config": name,
        "round": round_index,
        "command": " ".join(commands[0]) + (f"  (x{copies} at once)" if copies > 1 else ""),
        "processes": copies * nproc,
        "world_size": first["world_size"],
        "strategy": first["strategy"],
        "global_batch": first["global_batch"],
        "torch_threads": first["torch_threads"],
        "wall_s": wall,
        "foreign_cpu_share": foreign.share(),
        "samples_per_s": sum(p["samples_per_s"] for p in parts),
        "median_ms": first["median_ms"],
        "parts": parts,
    }


def check_threads(run: dict[str, Any]) -> str | None:
    """Why a run's thread count breaks the one-thread-per-process comparison, if it does."""
    threads = run["torch_threads"]
    if threads == 1:
        return None
    if threads is None:
        return f"could not tell how many torch threads {run['config']} trained with"
    return (f"{run['config']} trained with {threads} torch thread(s) per process, not 1"
            + (" (gpuflow gives each rank os.cpu_count() // nproc threads)"
               if run["world_size"] > 1 else ""))


def summarize(runs: list[dict[str, Any]], configs: list[str], nproc: int) -> dict[str, Any]:
    """Per-config medians over rounds, and each round's efficiency against its single run."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["config"]] = run
    rounds = sorted(by_round)
    per_config: dict[str, Any] = {}
    for name in configs:
        mine = [by_round[r][name] for r in rounds]
        per_config[name] = {
            "processes": mine[0]["processes"],
            "world_size": mine[0]["world_size"],
            "global_batch": mine[0]["global_batch"],
            "torch_threads": mine[0]["torch_threads"],
            "samples_per_s_per_round": [run["samples_per_s"] for run in mine],
            "median_samples_per_s": statistics.median(run["samples_per_s"] for run in mine),
            "median_ms": {key: median_or_none([run["median_ms"].get(key) for run in mine])
                          for key in mine[0]["median_ms"]},
        }
    efficiency: dict[str, Any] = {}
    for name in configs:
        if name == "single":
            continue
        per_round = [by_round[r][name]["samples_per_s"]
                     / (nproc * by_round[r]["single"]["samples_per_s"]) for r in rounds]
        entry: dict[str, Any] = {"per_round": per_round,
                                 "median": statistics.median(per_round)}
        if name != CONTROL and CONTROL in configs:
            # Against N independent processes: what communication alone costs.
            vs = [by_round[r][name]["samples_per_s"] / by_round[r][CONTROL]["samples_per_s"]
                  for r in rounds]
            entry["vs_independent_per_round"] = vs
            entry["vs_independent_median"] = statistics.median(vs)
        efficiency[name] = entry
    return {"configs": per_config, "efficiency": efficiency}


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def format_table(summary: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    header = (f"{'config':<12}{'procs':>6}{'batch':>7}{'samples/s per round':>28}"
              f"{'median':>9}{'step ms':>9}{'compute':>9}{'comm':>6}{'optim':>7}{'wait':>6}"
              f"{'other%':>8}   efficiency per round -> median")
    lines = [header, "-" * len(header)]
    efficiency = summary["efficiency"]

    def num(value: float | None, width: int) -> str:
        return f"{'-' if value is None else format(value, '.1f'):>{width}}"

    for name, stats in summary["configs"].items():
        ms = stats["median_ms"]
        foreign = [r["foreign_cpu_share"] for r in runs
                   if r["config"] == name and r["foreign_cpu_share"] is not None]
        other = f"{100 * max(foreign):.0f}" if foreign else "-"
        per_round = " ".join(f"{v:.0f}" for v in stats["samples_per_s_per_round"])
        eff = efficiency.get(name)
        eff_text = "(baseline)" if eff is None else (
            " ".join(f"{v:.3f}" for v in eff["per_round"]) + f" -> {eff['median']:.3f}")
        if eff is not None and "vs_independent_median" in eff:
            eff_text += f"  (vs independent {eff['vs_independent_median']:.3f})"
        lines.append(
            f"{name:<12}{stats['processes']:>6}{stats['global_batch']:>7}{per_round:>28}"
            f"{stats['median_samples_per_s']:>9.0f}{num(ms.get('step_time'), 9)}"
            f"{num(ms.get('compute'), 9)}{num(ms.get('comm'), 6)}{num(ms.get('optimizer'), 7)}"
            f"{num(ms.get('data_wait'), 6)}{other:>8}   {eff_text}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the parallel runs")
    parser.add_argument("--batch-size", type=int, default=2048,
                        help="per-rank micro-batch (see scaling_workload.py for the choice)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--log-every", type=int, default=4, help="steps per logged window")
    parser.add_argument("--skip-windows", type=int, default=2,
                        help="warm-up windows left out of each run's median")
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help=f"comma-separated, of {', '.join(PARALLEL)} (default: "
                             f"{','.join(DEFAULT_STRATEGIES)})")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=None,
                        help=f"the control: N {CONTROL} single processes at once, no "
                             "communication (default: on, off with --quick)")
    parser.add_argument("--wait-idle", type=float, default=120.0,
                        help="before each round, wait up to this many seconds for other "
                             "processes to go quiet (0: do not wait)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the run dirs here (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 round of 8 steps at micro-batch 64, no control "
                             "(under a minute)")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default: benchmarks/results/scaling-<machine>.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batch_size, args.steps, args.log_every = 1, 64, 8, 2
        args.wait_idle = 0.0
    if args.control is None:
        args.control = not args.quick
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategies if s not in PARALLEL]
    if unknown:
        parser.error(f"unknown strategy: {', '.join(unknown)}")
    if min(args.rounds, args.batch_size, args.steps, args.log_every) < 1 or args.nproc < 2:
        parser.error("--rounds, --batch-size, --steps and --log-every must be at least 1, "
                     "--nproc at least 2")
    if args.skip_windows < 0:
        parser.error("--skip-windows must be 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # This process only waits on the runs; at one thread, the machine record shows the
    # thread count every trained process uses.
    torch.set_num_threads(1)
    settings = Settings(args.nproc, args.batch_size, args.steps, args.log_every,
                        args.skip_windows)
    configs = ["single", *args.strategies] + ([CONTROL] if args.control else [])
    runs: list[dict[str, Any]] = []
    idle_before_round: list[float | None] = []
    cores = _common.usable_cores()
    if cores < args.nproc:
        print(f"warning: {args.nproc} ranks on {cores} usable core(s): they will share cores",
              file=sys.stderr)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuflow-scaling-") as tmp:
        workdir = args.workdir or Path(tmp)
        for index in range(args.rounds):
            if args.wait_idle > 0:
                idle_before_round.append(_common.wait_for_idle(args.wait_idle, log=log))
            order = configs[index % len(configs):] + configs[:index % len(configs)]
            for name in order:
                run = run_config(name, settings, workdir, index)
                runs.append(run)
                share = run["foreign_cpu_share"]
                other = "" if share is None else f", other processes {100 * share:.0f}% CPU"
                log(f"round {index + 1}/{args.rounds} {name}: {run['samples_per_s']:.0f} "
                    f"samples/s (wall {run['wall_s']:.1f} s{other})")
                problem = check_threads(run)
                if problem and run["torch_threads"] and name in ("single", CONTROL):
                    raise SystemExit(f"error: {problem}; the baseline must be one thread")
                if problem:
                    log(f"  warning: {problem}")
    wall = time.perf_counter() - started

    summary = summarize(runs, configs, args.nproc)
    efficiency = summary["efficiency"]
    target = {name: {"value": efficiency[name]["median"], "limit": TARGET,
                     "met": efficiency[name]["median"] >= TARGET}
              for name in args.strategies}
    table = format_table(summary, runs)
    print(table)
    print(f"\nefficiency = samples/s of {args.nproc} ranks / ({args.nproc} x samples/s of 1 "
          f"process), each round against its own single run; ms: median per step of the "
          f"steady windows as gpuflow splits them (compute: forward+backward without "
          f"comm; comm: exposed communication, DDP's all-reduce left after backward or "
          f"FSDP's gathers and reductions; optim: loss all-reduce + optimizer step); "
          f"other%: most CPU other "
          f"processes used during a run of that config")
    for name, verdict in target.items():
        print(f"{name}: median efficiency {verdict['value']:.3f} "
              f"{'>=' if verdict['met'] else '<'} {TARGET}: "
              f"{'met' if verdict['met'] else 'MISSED'}")
    foreign = [r["foreign_cpu_share"] for r in runs if r["foreign_cpu_share"] is not None]
    if foreign and max(foreign) > FOREIGN_LOAD_WARN:
        print(f"warning: other processes used up to {100 * max(foreign):.0f}% of the CPUs "
              "during some runs; those timings are not trustworthy", file=sys.stderr)

    result = {
        "benchmark": "scaling",
        **_common.provenance(),
        "machine": _common.machine_info(),
        "settings": {
            "rounds": args.rounds, "nproc": args.nproc, "per_rank_batch_size": args.batch_size,
            "steps": args.steps, "log_every": args.log_every,
            "skip_windows": args.skip_windows, "strategies": args.strategies,
            "control": args.control, "quick": args.quick,
            "wait_idle_s": args.wait_idle, "workload": WORKLOAD,
            "baseline_threads": "OMP_NUM_THREADS=1 (single process)",
            "rank_threads": "gpuflow's own: os.cpu_count() // nproc per rank",
            "precision": "fp32",
        },
        "wall_s": wall,
        "foreign_cpu_share_before_round": idle_before_round,
        "max_foreign_cpu_share": max(foreign) if foreign else None,
        **summary,
        "target": target,
        "all_targets_met": all(v["met"] for v in target.values()),
        "runs": runs,
        "table": table.splitlines(),
    }
    bad = [name for name, entry in efficiency.items()
           if not all(math.isfinite(v) and v > 0 for v in entry["per_round"])]
    out = args.out or _common.default_result_path("scaling")
    _common.write_json(out, result)
    print(f"\nresult written to {out}")
    if bad:
        print(f"ERROR: no usable efficiency for {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
