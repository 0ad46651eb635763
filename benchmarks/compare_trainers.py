"""gpuflow against a plain PyTorch loop, Lightning Fabric and Hugging Face Accelerate.

The same model, data, precision, batch size and step count are trained four ways on the CPU
or, with ``--device cuda``, on a GPU: ``gpuflow.Trainer`` (telemetry and metrics.jsonl on), a
hand-written loop, Fabric and Accelerate. Timing: the loops take turns in rounds inside one
process, in a rotating order, so machine drift hits all alike (the loops themselves are
``overhead.py``'s, plus one for Accelerate). Memory: each framework trains again in a fresh
process of its own, which reports its peak resident memory and how much it grew in set-up and
training, since one shared process cannot tell the frameworks' memory apart; on a GPU also
the CUDA allocator's peak. The probes repeat, the frameworks taking turns, and their medians
count: one probe's peak RSS moves by a few MiB.

Fabric and Accelerate are measured only when installed; they are never gpuflow
dependencies: ``pip install lightning accelerate``. A framework that is absent is skipped
with a line that says so.

Run: ``python benchmarks/compare_trainers.py`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402
import overhead  # noqa: E402

FRAMEWORKS = ("plain", "gpuflow", "fabric", "accelerate")
RATIO_TARGET = 1.01
MEMORY_STEPS = 30


def import_accelerate() -> tuple[Any, str | None, str | None]:
    """Accelerate's class and version, or None and why it cannot be measured."""
    try:
        from accelerate import Accelerator
    except ImportError as exc:
        return None, None, f"not importable ({exc})"
    return Accelerator, _common.package_version("accelerate"), None


class AccelerateLoop(overhead.FrameworkLoop):
    """The same loop through Accelerate's prepare() and backward()."""

    name = "accelerate"

    def __init__(self, accelerator_cls: Any, model: nn.Module, dataset: TensorDataset,
                 batch_size: int, precision: str, device: torch.device = overhead.CPU
                 ) -> None:
        self.module = model.train()
        self.accelerator = accelerator_cls(
            cpu=device.type == "cpu", mixed_precision="bf16" if precision == "bf16" else "no")
        loader, sampler = overhead.plain_loader(dataset, batch_size)
        self.model, self.optimizer, loader = self.accelerator.prepare(
            model, overhead.adamw_like_gpuflow(model), loader)
        self.batches = overhead.endless(loader, sampler)
        self.backward = self.accelerator.backward


IMPORTERS = {"fabric": overhead.import_fabric, "accelerate": import_accelerate}


def available(names: tuple[str, ...] = tuple(IMPORTERS)
              ) -> tuple[dict[str, Any], dict[str, str | None], dict[str, str]]:
    """Framework classes that import, their versions, and why the others are skipped."""
    classes: dict[str, Any] = {}
    found: dict[str, str | None] = {}
    skipped: dict[str, str] = {}
    for name in names:
        cls, version, reason = IMPORTERS[name]()
        if cls is None:
            skipped[name] = f"{reason}; install with: pip install lightning accelerate"
        else:
            classes[name], found[name] = cls, version
    return classes, found, skipped


def build_loop(name: str, classes: dict[str, Any], base: nn.Module, dataset: TensorDataset,
               batch_size: int, precision: str, total_steps: int, run_dir: Path,
               device: torch.device) -> overhead.Loop:
    model = copy.deepcopy(base)
    if name == "plain":
        return overhead.PlainLoop(model, dataset, batch_size, precision, device)
    if name == "gpuflow":
        return overhead.GpuflowLoop(model, dataset, batch_size, precision, total_steps, run_dir,
                                    device)
    if name == "fabric":
        return overhead.FabricLoop(classes["fabric"], model, dataset, batch_size, precision,
                                   device)
    return AccelerateLoop(classes["accelerate"], model, dataset, batch_size, precision, device)


def case_inputs(model_name: str) -> tuple[overhead.ModelSpec, TensorDataset, nn.Module]:
    spec = overhead.MODELS[model_name]
    torch.manual_seed(overhead.SEED)
    return spec, overhead.make_dataset(spec), spec.build()


def resident_bytes(field: str = "VmRSS") -> int:
    """Resident memory of this process now (VmRSS) or at its peak (VmHWM), Linux.

    Not getrusage's ru_maxrss: Linux carries that across fork and exec, so a child would
    report its parent's peak.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def probe_memory(name: str, model_name: str, precision: str, device: torch.device
                 ) -> dict[str, int | None]:
    """In this (fresh) process: train ``name`` for MEMORY_STEPS and report its memory: the
    process's resident peak and, on a GPU, the most the caching allocator handed out."""
    # Only this framework is imported, so the peak is its own, not every framework's import.
    classes, _, _ = available(tuple(n for n in IMPORTERS if n == name))
    spec, dataset, base = case_inputs(model_name)
    with tempfile.TemporaryDirectory(prefix="gpuflow-compare-") as workdir:
        # Growth counts the framework's set-up too (gpuflow's FLOP-counting step, wrappers),
        # from the same starting point for all: model and data built, framework imported.
        gc.collect()
        before = resident_bytes()
        loop = build_loop(name, classes, base, dataset, spec.batch_size, precision,
                          MEMORY_STEPS, Path(workdir) / "run", device)
        loop.run(MEMORY_STEPS)
        loop.close()
        peak = resident_bytes("VmHWM")
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"peak_rss_bytes": peak, "growth_bytes": max(0, peak - before),
            "peak_device_bytes": device_peak}


def measure_memory(names: list[str], model_name: str, precision: str, threads: int,
                   device: torch.device, repeats: int) -> dict[str, dict[str, Any]]:
    """Each framework's memory probe ``repeats`` times, the frameworks taking turns; the
    median of each figure, with every probe's, since one probe's peak moves by a few MiB."""
    probes: dict[str, list[dict[str, int | None]]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            command = [sys.executable, __file__, "--probe-memory", name, "--models", model_name,
                       "--precisions", precision, "--threads", str(threads),
                       "--device", device.type]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            probes[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out: dict[str, dict[str, Any]] = {}
    for name, runs in probes.items():
        out[name] = {key: (None if runs[0][key] is None
                           else int(statistics.median(run[key] for run in runs)))
                     for key in runs[0]}
        out[name]["probes"] = runs
    return out


def run_case(model_name: str, precision: str, names: list[str], classes: dict[str, Any],
             rounds: int, warmup_rounds: int, round_seconds: float, workdir: Path,
             device: torch.device) -> dict[str, Any]:
    """Interleaved timing rounds of every framework on one model and precision."""
    spec, dataset, base = case_inputs(model_name)
    steps = overhead.calibrate(base, dataset, spec.batch_size, precision, round_seconds, device)
    total = (warmup_rounds + rounds) * steps
    loops = [build_loop(name, classes, base, dataset, spec.batch_size, precision, total,
                        workdir / f"{model_name}-{precision}", device) for name in names]
    times, wall, foreign_share = overhead.timed_rounds(loops, steps, warmup_rounds, rounds)
    stats = overhead.summarize(times, steps)
    step_ms = stats["median_step_ms"]
    return {
        "model": model_name, "about": spec.about, "precision": precision,
        "batch_size": spec.batch_size, "steps_per_round": steps, "rounds": rounds,
        "warmup_rounds": warmup_rounds, "wall_s": wall, "foreign_cpu_share": foreign_share,
        "median_step_ms": step_ms,
        "samples_per_s": {name: spec.batch_size / (ms / 1e3) for name, ms in step_ms.items()},
        "vs_plain": {name: stats[name] for name in names if name != "plain"},
        "round_times_s": times,
    }


def _resolved(ci95: list[float], limit: float) -> bool:
    """Whether the 95% interval lies wholly on one side of ``limit``: if not, this machine's
    noise is too large to tell, whatever the median says."""
    return ci95[1] <= limit or ci95[0] > limit


def verdict(case: dict[str, Any]) -> dict[str, Any]:
    """gpuflow the fastest framework, within 1% of the plain loop, at no more memory; each
    time call with whether the noise resolves it."""
    step_ms, memory = case["median_step_ms"], case["memory"]
    ratio = case["vs_plain"]["gpuflow"]["median_ratio"]
    ratio_ci95 = case["vs_plain"]["gpuflow"]["median_ratio_ci95"]
    others = [name for name in step_ms if name not in ("plain", "gpuflow")]
    # gpuflow against each framework on their paired per-round ratios, which cancel the
    # machine's drift between rounds, rather than on medians taken over different rounds.
    against = {}
    for name in others:
        ratios, _ = overhead.paired(case["round_times_s"], "gpuflow", name,
                                    case["steps_per_round"])
        ci95 = overhead.median_ci(ratios)
        against[name] = {"median_ratio": statistics.median(ratios), "median_ratio_ci95": ci95,
                         "resolved": _resolved(ci95, 1.0)}
    growth = {name: m["growth_bytes"] for name, m in memory.items()}
    peak = {name: m["peak_rss_bytes"] for name, m in memory.items()}
    device_peak = {name: m.get("peak_device_bytes") for name, m in memory.items()}
    return {
        "fastest_framework": all(a["median_ratio"] <= 1.0 for a in against.values()),
        "fastest_framework_resolved": all(a["resolved"] for a in against.values()),
        "frameworks_compared": others, "gpuflow_vs": against,
        "within_1pct_of_plain": ratio <= RATIO_TARGET,
        "within_1pct_resolved": _resolved(ratio_ci95, RATIO_TARGET),
        "ratio": ratio, "ratio_ci95": ratio_ci95,
        "no_more_memory_growth": growth["gpuflow"] <= growth["plain"],
        "no_higher_peak_rss": peak["gpuflow"] <= peak["plain"],
        "no_higher_peak_device_memory": (None if device_peak["plain"] is None
                                         else device_peak["gpuflow"] <= device_peak["plain"]),
    }


def format_table(cases: list[dict[str, Any]]) -> str:
    lines = [f"{'case':<18}{'framework':<12}{'step ms':>9}{'samples/s':>11}{'vs plain':>10}"
             f"{'peak RSS MiB':>14}{'growth MiB':>12}{'device MiB':>12}"]
    lines.append("-" * len(lines[0]))
    for case in cases:
        label = f"{case['model']} {case['precision']}"
        for name, ms in case["median_step_ms"].items():
            ratio = 1.0 if name == "plain" else case["vs_plain"][name]["median_ratio"]
            memory = case["memory"][name]
            lines.append(f"{label:<18}{name:<12}{ms:>9.3f}{case['samples_per_s'][name]:>11,.0f}"
                         f"{ratio:>10.4f}{memory['peak_rss_bytes'] / 2**20:>14,.1f}"
                         f"{memory['growth_bytes'] / 2**20:>12,.1f}"
                         f"{_mib(memory.get('peak_device_bytes')):>12}")
            label = ""
    return "\n".join(lines)


def verdict_line(case: dict[str, Any]) -> str:
    """One case's verdicts, each timing one with its interval or 'within noise'."""
    target = case["target"]
    vs_others = ", ".join(
        f"gpuflow/{name} {a['median_ratio']:.4f} ({a['median_ratio_ci95'][0]:.4f}-"
        f"{a['median_ratio_ci95'][1]:.4f})" for name, a in target["gpuflow_vs"].items())
    device = ("" if target["no_higher_peak_device_memory"] is None else
              f"; device peak <= plain: {target['no_higher_peak_device_memory']}")
    return (f"{case['model']} {case['precision']}: gpuflow/plain {target['ratio']:.4f} "
            f"(95% CI {target['ratio_ci95'][0]:.4f}-{target['ratio_ci95'][1]:.4f}); "
            f"fastest framework: {target['fastest_framework']}"
            f"{_noise(target['fastest_framework_resolved'])}"
            + (f" [{vs_others}]" if vs_others else "") + "; within 1%: "
            f"{target['within_1pct_of_plain']}{_noise(target['within_1pct_resolved'])}; "
            f"memory growth <= plain: {target['no_more_memory_growth']}; peak RSS <= plain: "
            f"{target['no_higher_peak_rss']}{device}")


def _noise(resolved: bool) -> str:
    return "" if resolved else " (within noise)"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per case")
    parser.add_argument("--warmup-rounds", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--round-seconds", type=float, default=0.2,
                        help="calibration target: seconds per round for each framework")
    parser.add_argument("--memory-repeats", type=int, default=3,
                        help="fresh-process memory probes per framework; medians reported")
    parser.add_argument("--models", default="transformer,cnn",
                        help=f"comma-separated subset of {', '.join(overhead.MODELS)}")
    parser.add_argument("--precisions", default="fp32", help="comma-separated: fp32, bf16")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the cores this process may use)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where every framework trains (default cpu)")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default: benchmarks/results/compare_trainers-"
                             "<machine>.json)")
    parser.add_argument("--probe-memory", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.precisions = [p for p in args.precisions.split(",") if p]
    bad = [m for m in args.models if m not in overhead.MODELS]
    bad += [p for p in args.precisions if p not in ("fp32", "bf16")]
    if args.memory_repeats < 1:
        parser.error("--memory-repeats must be at least 1")
    if bad:
        parser.error(f"unknown model or precision: {', '.join(bad)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    args.device = torch.device(args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or _common.usable_cores()
    torch.set_num_threads(threads)
    if args.probe_memory:
        print(json.dumps(probe_memory(args.probe_memory, args.models[0], args.precisions[0],
                                      args.device)))
        return 0
    classes, found, skipped = available()
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=sys.stderr)
    names = [name for name in FRAMEWORKS if name in ("plain", "gpuflow") or name in classes]
    cases = []
    with tempfile.TemporaryDirectory(prefix="gpuflow-compare-") as workdir:
        for model_name in args.models:
            for precision in args.precisions:
                print(f"running {model_name} {precision} ...", file=sys.stderr, flush=True)
                case = run_case(model_name, precision, names, classes, args.rounds,
                                args.warmup_rounds, args.round_seconds, Path(workdir),
                                args.device)
                case["memory"] = measure_memory(names, model_name, precision, threads,
                                                args.device, args.memory_repeats)
                case["target"] = verdict(case)
                cases.append(case)
    table = format_table(cases)
    print(table)
    print("\nstep ms: median over rounds; vs plain: median of per-round ratios; peak RSS: "
          f"median of {args.memory_repeats} fresh processes per framework, each after "
          f"{MEMORY_STEPS} steps; growth: RSS added by training there; device: the CUDA "
          "allocator's peak there")
    verdicts = [verdict_line(case) for case in cases]
    print("\n".join(verdicts))
    shares = [c["foreign_cpu_share"] for c in cases if c["foreign_cpu_share"] is not None]
    result = {
        "benchmark": "compare_trainers",
        **_common.provenance(**{f"{name}_version": v for name, v in found.items()}),
        "machine": _common.machine_info(),
        "settings": {"rounds": args.rounds, "warmup_rounds": args.warmup_rounds,
                     "round_seconds": args.round_seconds, "memory_steps": MEMORY_STEPS,
                     "memory_repeats": args.memory_repeats,
                     "device": args.device.type, "seed": overhead.SEED, "lr": overhead.LR,
                     "optimizer": "adamw", "frameworks": names},
        "skipped": skipped,
        "max_foreign_cpu_share": max(shares, default=None),
        "cases": cases,
        "table": table.splitlines(),
        "verdicts": verdicts,
    }
    out = args.out or _common.default_result_path("compare_trainers")
    _common.write_json(out, result)
    print(f"\nresult written to {out}")
    if result["max_foreign_cpu_share"] and result["max_foreign_cpu_share"] > 0.05:
        print(f"warning: other processes used up to {100 * result['max_foreign_cpu_share']:.0f}%"
              " of the CPUs meanwhile; these timings are not trustworthy", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
