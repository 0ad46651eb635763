"""Write docs/benchmarks.md from benchmarks/results/*.json, so the figures in the docs are
always the latest measured ones, each with its command, machine and date.

Every result file holds ``benchmark``, ``created``, ``command``, ``git``, ``machine`` and
``versions``, recorded by the script that wrote it (``_common.provenance``); most hold a
printed ``table`` too. A result without a table gets its headline figures listed instead.
Files from before the scripts recorded their commit say so.

It also renders docs/performance.md's table of every GPU stage's figures (``gpu_stages``),
between that page's two markers, so that neither page can drift from the files.

Run: ``python benchmarks/render_docs.py`` (``make bench`` runs it after the benchmarks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_stages  # noqa: E402

RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "benchmarks.md"
PERFORMANCE = HERE.parent / "docs" / "performance.md"
GPU_TABLE = ("<!-- GPU figures: rendered by benchmarks/render_docs.py -->",
             "<!-- end of the GPU figures -->")

ABOUT = {
    "overhead": "gpuflow's Trainer against a plain PyTorch loop (and Lightning Fabric): "
                "per-step cost of the engine and its telemetry; bitwise-equal weights.",
    "scaling": "data-parallel scaling through `gpuflow train`: 1 process vs N (ddp, fsdp "
               "per block, fsdp as one unit), at a per-rank micro-batch of 2048 by default.",
    "lockstep": "what ranks that synchronise at every block (as FSDP's collectives make "
                "them) pay on this machine with no communication: N processes train alone, "
                "free-running and with a barrier per block, interleaved.",
    "compare_trainers": "the same training in gpuflow, a plain loop, Lightning Fabric and "
                        "Hugging Face Accelerate: step time, throughput, memory.",
    "gpu_suite": "matmul peak, textlm 124m/1b bf16 and fp8 compiled training (tokens/s, "
                 "MFU), CUDA graphs, the planner's predictions, FSDP's exposed communication, "
                 "trainer comparison and serving on one GPU.",
    "serving": "dynamic batching against batch size 1 in `gpuflow serve`.",
    "input_pipeline": "time each training step waits for its batch, raw and packed data, "
                      "and the loader's throughput alone.",
    "image_loader": "224x224 training crops decoded per second per core: the images "
                    "workload's pipeline against a tutorial-style loader, on ImageNet-sized "
                    "and photo-sized JPEGs (images/s per core, median ratio of the rounds).",
}


def _machine(result: dict[str, Any]) -> str:
    machine = result.get("machine", {})
    parts = [machine.get("gpu") or machine.get("cpu_model") or machine.get("hostname", "?")]
    if machine.get("usable_cores"):
        parts.append(f"{machine['usable_cores']} usable cores")
    if machine.get("torch_threads"):
        parts.append(f"{machine['torch_threads']} torch threads")
    return ", ".join(str(p) for p in parts)


def _foreign_load(result: dict[str, Any]) -> float | None:
    """The largest share of the CPUs other processes used while the benchmark ran."""
    shares = [result.get("max_foreign_cpu_share"), result.get("foreign_cpu_share")]
    shares += [case.get("foreign_cpu_share") for case in result.get("cases", [])]
    known = [share for share in shares if share is not None]
    return max(known) if known else None


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.1f} GiB"


def _error(pair: dict[str, Any]) -> str:
    return "not measured" if pair.get("error") is None else f"{100 * pair['error']:+.0f}%"


def _last_line(value: Any) -> Any:
    """A stage's error tail as its last line (the line that says why it stopped)."""
    if not isinstance(value, str) or "\n" not in value.strip():
        return value
    return value.strip().splitlines()[-1]


def _gpu_suite_lines(result: dict[str, Any]) -> list[str]:
    runs = [*result.get("train", []), *result.get("cuda_graphs", [])]
    lines = ["| run | tokens/s | MFU | step | peak memory | planner: step, memory (error) "
             "| target |", "|---|---|---|---|---|---|---|"] if runs else []
    for run in runs:
        label = run.get("label", run["model_size"])
        if not run.get("step_time_s"):
            why = run.get("refused") or f"failed (exit {run.get('exit_code')})"
            lines.append(f"| textlm {label} | not measured: {why} | | | | | |")
            continue
        mfu = "n/a" if run["mfu"] is None else f"{100 * run['mfu']:.1f}%"
        target = run.get("target")
        verdict = "" if target is None else (
            f">= {100 * target['mfu_min']:.0f}%: {'met' if target['met'] else 'not met'}")
        planner = run.get("planner")
        predicted = "" if not planner else (
            f"{planner['step_time_s']['predicted']:.4f} s "
            f"({_error(planner['step_time_s'])}), "
            f"{_gib(planner['peak_mem_bytes']['predicted'])} "
            f"({_error(planner['peak_mem_bytes'])})")
        lines.append(f"| textlm {label} | {run['tokens_per_s']:,.0f} | {mfu} | "
                     f"{run['step_time_s']:.4f} s | {_gib(run.get('peak_mem_bytes'))} | "
                     f"{predicted} | {verdict} |")
    if result.get("train"):
        source = next((run["peak_flops_source"] for run in result["train"]
                       if "peak_flops_source" in run), None)
        if source:
            lines += ["", f"MFU against: {source}."]
    for name, verdict in result.get("verdicts", {}).items():
        shown = {k: f"{v:.3f}" if isinstance(v, float) else _last_line(v)
                 for k, v in verdict.items()}
        lines.append(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    matmul = result.get("matmul", {})
    if matmul:
        lines += ["", f"bf16 matmul probe: {matmul['bf16_tflops']:.2f} TFLOP/s on "
                      f"{matmul.get('device_name', '?')}."]
    probe = result.get("batch_size_auto", {})
    if probe.get("probe"):
        found = probe["probe"]
        lines += ["", f"`--batch-size auto` (textlm {probe['model_size']}, global batch "
                      f"{probe['global_batch']}): largest fitting micro-batch "
                      f"{found['largest_fitting']}, ran {found['micro_batch']} x "
                      f"{found['grad_accum']} accumulation."]
    for name in ("serving", "serving_cuda_graphs"):
        runs = (result.get(name) or {}).get("runs")
        if runs:
            figures = "; ".join(
                f"{config}: {r['requests_per_s']:.1f} req/s, p50 {r['p50_ms']:.0f} ms, "
                f"p99 {r['p99_ms']:.0f} ms, mean batch {r['mean_batch_rows']:.1f}"
                for config, r in runs.items())
            lines += ["", f"{name} ({result[name].get('model', '?')}): {figures}."]
    for name in ("generation", "generation_cuda_graphs"):
        for contender, by_clients in ((result.get(name) or {}).get("tokens_per_s") or {}).items():
            figures = ", ".join(f"{clients} clients {value:,.0f}"
                                for clients, value in by_clients.items() if value)
            lines += ["", f"{name}, {contender}: output tokens/s {figures}."]
    stopped = {name: _last_line(entry["error"]) for name, entry in result.items()
               if isinstance(entry, dict) and entry.get("error") and name != "verdicts"}
    if stopped:
        lines += ["", *(f"- {name} not measured: {why}" for name, why in stopped.items())]
    return lines


def _input_pipeline_lines(result: dict[str, Any]) -> list[str]:
    lines = ["| workload | run | data_wait_frac | step | trained samples/s | loader alone |",
             "|---|---|---|---|---|---|"]
    for workload, figures in result.get("workloads", {}).items():
        for run, r in figures["runs"].items():
            loader = r.get("loader_samples_per_s")
            lines.append(f"| {workload} | {run} | {r['data_wait_frac']:.4f} | "
                         f"{1e3 * r['step_time_s']:.1f} ms | {r['samples_per_s']:,.0f} | "
                         + ("-" if loader is None else f"{loader:,.0f}") + " |")
    lines += ["", f"Target: data_wait_frac <= {result.get('target_data_wait_frac')} at "
                  f"{result.get('target_judged_at_workers', 0)} loader workers (the default); "
                  f"met: {'yes' if result.get('all_meet_target') else 'no'}."]
    return lines


def _figure(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{key} {_figure(item)}" for key, item in value.items())
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _scalars(result: dict[str, Any]) -> list[str]:
    """A result's headline ``figures`` (nested ones on one line), then its top-level scalars."""
    skip = {"benchmark", "created", "command", "machine", "versions", "settings"}
    figures = [f"- `{key}`: {_figure(value)}" for key, value in result.get("figures", {}).items()]
    return figures + [f"- `{key}`: {_figure(value)}" for key, value in result.items()
                      if key not in skip and isinstance(value, int | float | str | bool)]


def section(path: Path, result: dict[str, Any]) -> list[str]:
    name = result.get("benchmark", path.stem)
    versions = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items() if v)
    lines = [f"## {name} ({path.stem.removeprefix(name + '-')})", ""]
    if name in ABOUT:
        lines += [ABOUT[name], ""]
    date = result.get("created") or result.get("timestamp") or result.get("date", "?")
    lines += [f"- command: `{result.get('command', '?')}`",
              f"- machine: {_machine(result)}",
              f"- date: {date}",
              f"- versions: {versions or '?'}"]
    git = result.get("git")
    if git and git.get("commit"):
        state = {True: ", with uncommitted changes in the tree", False: "",
                 None: ", whether the tree had uncommitted changes not known"}[git.get("dirty")]
        given = "" if git.get("source", "git") == "git" else f" (from {git['source']})"
        lines.append(f"- measured at commit {git['commit'][:12]}{state}{given}")
    elif result.get("git_commit"):
        lines.append(f"- commit {result['git_commit']}, added to the file after the run "
                     "(the script did not record it then)")
    else:
        lines.append("- commit not recorded (the script did not record it then)")
    if result.get("partial"):
        lines.append(f"- a partial run with chosen settings ({result.get('selection')}), "
                     "not the full suite")
    load = _foreign_load(result)
    if load is not None:
        lines.append(f"- other processes' CPU share meanwhile: up to {100 * load:.0f}%"
                     + (" (timings not trustworthy)" if load > 0.05 else ""))
    if "all_targets_met" in result:
        lines.append(f"- all targets met: {'yes' if result['all_targets_met'] else 'no'}")
    if result.get("dry_run"):
        lines.append("- dry run (CPU, tiny sizes): checks the script, not the GPU figures")
    lines.append("")
    if name == "gpu_suite":
        lines += _gpu_suite_lines(result)
    elif name == "input_pipeline":
        lines += _input_pipeline_lines(result)
    elif result.get("table"):
        table = result["table"]
        lines += ["```", *(table if isinstance(table, list) else [str(table)]), "```"]
        lines += ["", *(f"- {verdict}" for verdict in result.get("verdicts", []))]
    else:
        lines += _scalars(result)
    lines += ["", f"Source: `benchmarks/results/{path.name}`.", ""]
    return lines


def render(results_dir: Path = RESULTS) -> str:
    lines = ["# Benchmarks", "",
             "The latest result of every benchmark in `benchmarks/`, generated by "
             "`benchmarks/render_docs.py` from `benchmarks/results/*.json` (`make bench` "
             "reruns the benchmarks and this page). Timings on a shared machine vary; each "
             "section says how busy the machine was.", ""]
    for path in sorted(results_dir.glob("*.json")):
        lines += section(path, json.loads(path.read_text()))
    return "\n".join(lines).rstrip() + "\n"


def with_gpu_table(page: str, results_dir: Path = RESULTS) -> str:
    """``page`` with the GPU figures between ``GPU_TABLE``'s markers rendered afresh."""
    begin, end = GPU_TABLE
    head, rest = page.split(begin, 1)
    tail = rest.split(end, 1)[1]
    return "\n".join([head + begin, *gpu_stages.table(results_dir), end]) + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=DOC)
    args = parser.parse_args(argv)
    args.out.write_text(render(args.results))
    PERFORMANCE.write_text(with_gpu_table(PERFORMANCE.read_text(), args.results))
    print(f"wrote {args.out} and the GPU figures of {PERFORMANCE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
