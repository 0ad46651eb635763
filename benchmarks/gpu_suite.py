"""The GPU benchmark suite: one call on a lent GPU, under 8 minutes, one results file.

Stages, in order of priority, each under its own time limit and skipped when the suite's
budget runs short (the results file is rewritten after every stage, so a cut-off run still
leaves what it measured, and says what it skipped):

1. ``matmul``: the best bf16 ``torch.mm`` throughput, against the datasheet peak.
2. ``train``: ``gpuflow train --workload textlm`` (the pydoc corpus) at 124m and 1b, bf16 and
   fp8 (torchao, tensorwise), ``--compile``, with ``--strategy auto`` so that every summary
   records the planner's predicted memory and step time next to the measured ones. Targets
   on one H200 by the field's MFU convention (dense bf16 peak 989 TFLOP/s): MFU >= 50% at
   124m and >= 62% at 1b in bf16; fp8 at 1b >= 1.25x bf16's tokens/s with a validation loss
   within 2% of bf16's after the same steps; planner errors within 15%.
3. ``generation``: ``benchmarks/generation.py --device cuda --precision bf16``, textlm 124m
   through /v1/completions (the generation engine) and /v1/predict's no-cache loop, eager
   and with ``--cuda-graphs`` (decode steps replayed as a CUDA graph per batch bucket):
   output tokens/s at 1, 8, 32 and 64 clients (the Hugging Face export's server is the CPU
   benchmark's contender, left out here).
   ``generation-real``: ``benchmarks/gpu_generation.py`` (issue 50): SmolLM2-135M-Instruct
   and a config-only 1B Llama in bf16 at 1, 8, 64 and 256 clients, 128-token prompts and
   outputs: tokens/s, TTFT and ITL p50/p99, the share of graphed steps. Targets: SmolLM2
   ITL p50 <= 2 ms at one client and >= 25,000 tok/s at 256; the 1B >= 250 tok/s at one
   client and >= 10,000 at 256. SmolLM2 comes from ``$GPUFLOW_SMOLLM2_DIR`` (a carried
   folder of its config and tokenizer files gives random weights of its shape; the script's
   docstring says more), else it and the 1B are skipped, saying why.
4. ``cuda-graphs``: a launch-bound configuration (textlm tiny, micro-batch 16) compiled, then
   with ``--cuda-graphs``. Target: >= 1.3x the steps/s.
5. ``serving``: ``benchmarks/serving.py --device cuda``, dynamic batching against batch size 1,
   also with ``--cuda-graphs``.
6. ``plan``: ``gpuflow plan`` for the 124m run, with the default efficiency and with
   ``--measure`` (a short run of the model on this GPU), next to the train stage's step.
7. ``fsdp-comm``: FSDP on the device (one process, ``--compile``): its exposed
   communication is measured and the step's breakdown adds up.
8. ``compare``: ``benchmarks/compare_trainers.py --device cuda``, gpuflow against a plain
   loop, Lightning Fabric and Accelerate (those installed; the others are listed as skipped,
   with why). Target: gpuflow/plain within 1% (95% interval).
The compiled runs share textlm 124m's block graph where they can, so that inductor's cache
saves the later ones most of their compile.

On the H200 (2026-12-04, torch 2.11) the stages took about: matmul 1 s, train 223 s,
generation 97-132 s eager and 184 s with CUDA graphs (a run whose compile fell back to
eager), cuda-graphs 82 s, serving 118 s, plan 43 s, fsdp-comm 34 s, compare over 67 s: more
than one 450 s call. The budget runs them in the order above; what it skips
is listed in the results file, and a second call runs it:
``--stages serving,plan,fsdp-comm,compare`` (written beside the full run's file).
Not in the default set: ``batch-auto`` (``--batch-size auto`` running out of memory and
recovering) and ``fp16-resume`` (fp16 with a GradScaler, then a resume).

The suite runs on the machine's own torch (``gpu_suite.sh`` takes the machine's python3 where
there is no .venv) and records it with the date, the full command line, the commit and
whether the tree was dirty; a run of chosen stages or runs is labelled a partial run and
written beside the full run's file, never over it.

    bash benchmarks/gpu_suite.sh             # on the GPU machine
    bash benchmarks/gpu_suite.sh --dry-run   # every stage on the CPU at tiny sizes (CI)

``gpu_suite.sh --pending`` runs instead the stages whose results are missing or stale
(``gpu_queue.py``), each into a file of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402

STAGES = ("matmul", "train", "generation", "generation-real", "cuda-graphs", "serving", "plan",
          "fsdp-comm", "compare", "batch-auto", "fp16-resume")
DEFAULT_STAGES = STAGES[:9]
GENERATION_REAL_BUDGET_S = 300  # gpu_generation.py's own estimate: 4-5 minutes on an H100
DEFAULT_BUDGET_S = 450
TARGETS = {"mfu_bf16": {"124m": 0.50, "1b": 0.62}, "fp8_speedup": 1.25, "fp8_loss_rel": 0.02,
           "cuda_graphs_speedup": 1.3, "planner_error": 0.15, "vllm_tokens_ratio": 0.5}

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
    precision: str
    global_batch: int
    steps: int
    log_every: int
    flags: tuple[str, ...] = ()
    data: str = "real"
    # --strategy auto puts the planner's predictions in the summary; the CUDA-graph runs
    # name their strategy instead, which --cuda-graphs needs to know before the run.
    planned: bool = True
    # A training lever against today's step: run only when --runs names it (a GPU stage).
    lever: bool = False


def train_runs(dry_run: bool) -> list[TrainRun]:
    """The targets' configurations first, so that a short lease still measures them."""
    if dry_run:
        return [TrainRun("dry-bf16", DRY_MODEL, "bf16", 4, 6, 2),
                TrainRun("dry-fp8", DRY_MODEL, "fp8", 4, 6, 2)]
    compiled = ("--compile",)
    return [TrainRun("124m-bf16", "124m", "bf16", 64, 30, 10, compiled),
            TrainRun("1b-bf16", "1b", "bf16", 16, 15, 5, compiled),
            TrainRun("1b-fp8", "1b", "fp8", 16, 15, 5, compiled),
            TrainRun("124m-fp8", "124m", "fp8", 64, 30, 10, compiled),
            *lever_runs(compiled)]


def lever_runs(compiled: tuple[str, ...]) -> list[TrainRun]:
    """Today's steps with one lever switched (docs/training.md, docs/precision.md): in bf16,
    foreach AdamW in place of the fused kernel, the loss over 8 chunks (never the whole fp32
    logits), the whole model compiled as one graph; fp8 on every layer it can run, not only
    those torchao's thresholds pick (at 124m: at 1b they pick all)."""
    both = ("124m", "1b")
    levers = {"foreach": ("bf16", ("--optimizer-impl", "foreach"), both),
              "chunked": ("bf16", ("--loss-chunks", "8"), both),
              "whole": ("bf16", ("--compile-scope", "model"), both),
              "all": ("fp8", ("--fp8-min-features", "0"), ("124m",))}
    shapes = {"124m": (64, 30, 10), "1b": (16, 15, 5)}
    return [TrainRun(f"{size}-{precision}-{name}", size, precision, *shapes[size],
                     (*compiled, *flags), lever=True)
            for name, (precision, flags, sizes) in levers.items() for size in sizes]


def graph_runs(dry_run: bool) -> list[TrainRun]:
    """Launch-bound: a small model at a small batch, compiled, then replayed as graphs (the
    dry run leaves --compile out, whose cold start costs a CPU half a minute)."""
    size, steps, every = (DRY_MODEL, 6, 2) if dry_run else ("tiny", 120, 20)
    plain = () if dry_run else ("--compile",)
    common = dict(data="synthetic", planned=False)
    return [TrainRun("graphs-off", size, "bf16", 16, steps, every, plain, **common),
            TrainRun("graphs-on", size, "bf16", 16, steps, every, ("--cuda-graphs",), **common)]


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
        self.result["wall_time_s"] = time.monotonic() - self.started
        _common.write_json(self.out, self.result)

    def run(self, name: str, command: list[str], limit_s: float,
            stdout: Path | None = None) -> tuple[int | None, str]:
        """Run a command under ``min(limit_s, time left)``; returns (exit code, log path).
        None: not run (budget) or stopped at its limit, as the log says."""
        limit = min(limit_s, self.left_s())
        log_path = self.work / f"{name}.log"
        if limit < 20:
            log_path.write_text(f"skipped: {self.left_s():.0f} s of the budget left\n")
            self.result.setdefault("skipped", []).append(name)
            return None, str(log_path)
        with log_path.open("w") as log, (stdout.open("w") if stdout else log) as out:
            try:
                done = subprocess.run(command, stdout=out, stderr=log, timeout=limit, cwd=ROOT)
                return done.returncode, str(log_path)
            except subprocess.TimeoutExpired:
                log.write(f"\n[gpu_suite] stopped after {limit:.0f} s\n")
                return None, str(log_path)


def tail(path: str, chars: int = 2000) -> str:
    return Path(path).read_text(errors="replace")[-chars:]


def failure(code: int | None, log: str) -> dict[str, Any]:
    """A run that did not finish: gpuflow's own refusal (exit 2) is quoted on its own."""
    text = Path(log).read_text(errors="replace")
    refusal = re.findall(r"gpuflow: (?:rank \d+: )?error: (.*)", text)
    if code == 2 and refusal:
        return {"exit_code": code, "refused": refusal[-1]}
    return {"exit_code": code, "error": text[-2000:]}


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


def chosen_stages(parser: argparse.ArgumentParser, listed: str,
                  known: tuple[str, ...]) -> list[str]:
    """The comma-separated stages asked for; an unknown one is refused (exit 2)."""
    stages = listed.split(",")
    if set(stages) - set(known):
        parser.error(f"unknown stage(s) {sorted(set(stages) - set(known))}; choose from {known}")
    return stages


def gpuflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpuflow.cli", *args]


def planner_errors(summary: dict[str, Any]) -> dict[str, Any] | None:
    pairs = (summary.get("plan") or {}).get("predicted_vs_measured")
    if not pairs:
        return None
    return {key: {"predicted": predicted, "measured": measured,
                  "error": (predicted - measured) / measured if predicted and measured
                  else None}
            for key, (predicted, measured) in pairs.items()}


def summarize_run(run: TrainRun, run_dir: Path) -> dict[str, Any]:
    s = json.loads((run_dir / "summary.json").read_text())
    median = s["median"]
    entry: dict[str, Any] = {
        "label": run.label, "model_size": run.model_size, "precision": run.precision,
        "tokens_per_s": median.get("tokens_per_s"), "mfu": median.get("mfu"),
        "step_time_s": median.get("step_time_s"),
        "data_wait_frac": median.get("data_wait_frac"),
        "peak_flops": s["peak_flops"], "peak_flops_source": s["peak_flops_source"],
        "peak_mem_bytes": s["peak_mem_bytes"], "peak_mem_kind": s["peak_mem_kind"],
        "compiled": s["compiled"], "compile_scope": s.get("compile_scope"),
        "precision_description": s.get("precision_description"), "fp8": s.get("fp8"),
        "global_batch": s["global_batch"], "steps": s["steps"], "wall_time_s": s["wall_time_s"],
        "device_name": s["device_name"], "final_metrics": s["final_metrics"],
        "config": s["config"],
    }
    planner = planner_errors(s)
    if planner:
        entry["planner"] = planner
    return entry


def train_stage(suite: Suite, key: str, runs: list[TrainRun], device: str,
                limit_s: float) -> None:
    results: list[dict[str, Any]] = []
    suite.result[key] = results
    for run in runs:
        run_dir = suite.work / f"textlm-{run.label}"
        suite.log(f"train textlm {run.label}")
        batch = (["--strategy", "auto", "--global-batch", str(run.global_batch)] if run.planned
                 else ["--strategy", "single", "--batch-size", str(run.global_batch)])
        code, log = suite.run(f"train-{run.label}", gpuflow(
            "train", "--workload", "textlm", "--data", run.data,
            "--model-size", run.model_size, "--device", device, "--precision", run.precision,
            *batch, "--max-steps", str(run.steps), "--log-every", str(run.log_every),
            "--warmup-steps", "5", "--eval-every", "0", "--no-checkpoints", "--no-progress",
            "--run-dir", str(run_dir), *run.flags), limit_s)
        if code == 0 and (run_dir / "summary.json").is_file():
            entry = summarize_run(run, run_dir)
        else:
            entry = {"label": run.label, "model_size": run.model_size,
                     "precision": run.precision, **failure(code, log)}
        results.append(entry)
        suite.save()


def _measured(runs: list[dict[str, Any]], label: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["label"] == label and r.get("step_time_s")), None)


def _why_not(runs: list[dict[str, Any]], *labels: str) -> str:
    for label in labels:
        run = next((r for r in runs if r["label"] == label), None)
        if run is None:
            return f"{label} not run"
        if not run.get("step_time_s"):
            return f"{label}: " + (run.get("refused") or f"exit {run.get('exit_code')}")
    return ""


def _against_vllm(generation: dict[str, Any]) -> dict[str, Any]:
    """gpuflow's output tokens/s over vLLM's at the highest concurrency both ran."""
    tokens = generation.get("tokens_per_s", {})
    if "vllm" not in tokens:
        why = "; ".join(generation.get("notes", [])) or generation.get("error", "not run")
        return {"measured": False, "why": why}
    level = max(set(tokens["vllm"]) & set(tokens["gpuflow"]), key=int)
    ratio = tokens["gpuflow"][level] / tokens["vllm"][level]
    return {"concurrency": int(level), "tokens_per_s_ratio": ratio,
            "target_min": TARGETS["vllm_tokens_ratio"],
            "met": ratio >= TARGETS["vllm_tokens_ratio"]}


def judge(result: dict[str, Any]) -> dict[str, Any]:
    """Every target of the issue against what this run measured; unmeasured ones say why."""
    train, graphs = result.get("train", []), result.get("cuda_graphs", [])
    verdicts: dict[str, Any] = {}
    for run in train:
        target = TARGETS["mfu_bf16"].get(run["model_size"])
        if run["precision"] == "bf16" and target and run.get("mfu") is not None:
            verdicts[f"mfu {run['label']}"] = {"measured": run["mfu"], "target_min": target,
                                               "met": run["mfu"] >= target}
    for size in sorted({run["model_size"] for run in train}):
        bf16_label, fp8_label = (next((r["label"] for r in train if r["model_size"] == size
                                       and r["precision"] == p), None) for p in ("bf16", "fp8"))
        if bf16_label is None or fp8_label is None:
            continue
        bf16, fp8 = _measured(train, bf16_label), _measured(train, fp8_label)
        if bf16 is None or fp8 is None:
            verdicts[f"fp8 vs bf16 {size}"] = {"measured": False,
                                               "why": _why_not(train, bf16_label, fp8_label)}
            continue
        speedup = fp8["tokens_per_s"] / bf16["tokens_per_s"]
        losses = (fp8["final_metrics"].get("val_loss"), bf16["final_metrics"].get("val_loss"))
        loss_rel = abs(losses[0] - losses[1]) / losses[1] if None not in losses else None
        verdicts[f"fp8 vs bf16 {size}"] = {
            "tokens_per_s_ratio": speedup, "val_loss": {"fp8": losses[0], "bf16": losses[1]},
            "val_loss_rel_diff": loss_rel, "speedup_target_min": TARGETS["fp8_speedup"],
            "loss_target_max": TARGETS["fp8_loss_rel"],
            "met": speedup >= TARGETS["fp8_speedup"] and loss_rel is not None
            and loss_rel <= TARGETS["fp8_loss_rel"]}
    off, on = _measured(graphs, "graphs-off"), _measured(graphs, "graphs-on")
    verdicts["cuda graphs"] = (
        {"steps_per_s_ratio": off["step_time_s"] / on["step_time_s"],
         "configuration": f"textlm {on['model_size']}, micro-batch {on['global_batch']}, bf16",
         "target_min": TARGETS["cuda_graphs_speedup"],
         "met": off["step_time_s"] / on["step_time_s"] >= TARGETS["cuda_graphs_speedup"]}
        if off and on else {"measured": False,
                            "why": _why_not(graphs, "graphs-off", "graphs-on")})
    eager, graphs_on = (result.get(name, {}).get("tokens_per_s", {}).get("gpuflow")
                        for name in ("generation", "generation_cuda_graphs"))
    if eager and graphs_on:  # no target in the issue: shown, not judged
        verdicts["generation cuda graphs"] = {
            "tokens_per_s_ratio": {level: graphs_on[level] / eager[level]
                                   for level in eager if eager[level] and level in graphs_on},
            "decode": result["generation_cuda_graphs"]["gpuflow_runs_on"]["decode"]}
    verdicts["generation vs vllm"] = _against_vllm(
        result.get("generation_cuda_graphs") or result.get("generation") or {})
    for name, verdict in (result.get("generation_real") or {}).get("verdicts", {}).items():
        verdicts[f"generation-real {name}"] = verdict
    # The planner has no fp8 model (it plans fp8 as bf16): those errors are shown, not judged.
    for name, fp8_runs in (("planner", False), ("planner, fp8 planned as bf16", True)):
        errors = {f"{run['label']} {key}": pair["error"] for run in train
                  if (run["precision"] == "fp8") == fp8_runs
                  for key, pair in (run.get("planner") or {}).items()
                  if pair["error"] is not None}
        if errors and fp8_runs:
            verdicts[name] = {"errors": errors}
        elif errors:
            verdicts[name] = {"errors": errors, "target_max": TARGETS["planner_error"],
                              "met": all(abs(e) <= TARGETS["planner_error"]
                                         for e in errors.values())}
    return verdicts


def plan_stage(suite: Suite, device: str) -> None:
    """The planner's prediction for the 124m bf16 run, by the default and by a measured
    efficiency, next to the train stage's measured step."""
    from gpuflow.planner.machine import gpu_type_of

    size, batch = (DRY_MODEL, 4) if suite.dry_run else ("124m", 64)
    # The dry run plans for an H200 by name, so that --measure's refusal on a CPU is exercised.
    gpu_type = "h200" if device == "cpu" else gpu_type_of(torch.cuda.get_device_name())
    entry: dict[str, Any] = {"model_size": size, "global_batch": batch, "gpu_type": gpu_type}
    suite.result["plan"] = entry
    if gpu_type is None:
        entry["error"] = f"the planner has no figures for {torch.cuda.get_device_name()}"
        suite.save()
        return
    base = ["plan", "--workload", "textlm", "--model-size", size, "--gpu-type", gpu_type,
            "--gpus", "1", "--global-batch", str(batch), "--precision", "bf16", "--json"]
    for name, extra in (("default", []), ("measured", ["--measure", "--compile"])):
        suite.log(f"plan textlm {size} ({name} efficiency)")
        out = suite.work / f"plan-{name}.json"
        code, log = suite.run(f"plan-{name}", gpuflow(*base, *extra), 150, stdout=out)
        if code != 0:
            entry[name] = failure(code, log)
            continue
        plan = json.loads(out.read_text())
        recommended = plan["recommended"] or plan["plans"][0]
        entry[name] = {"efficiency": plan["hardware"]["efficiency"],
                       "efficiency_source": plan["hardware"]["efficiency_source"],
                       "measured_run": plan.get("measured_run"),
                       "plan": recommended["strategy"],
                       "step_time_s": recommended["step_time_s"]["step"],
                       "peak_mem_bytes": recommended["memory_bytes"]["peak"]}
    train = _measured(suite.result.get("train", []), "124m-bf16" if not suite.dry_run
                      else "dry-bf16")
    if train:
        entry["train_step_time_s"] = train["step_time_s"]
        for name in ("default", "measured"):
            if "step_time_s" in entry.get(name, {}):
                entry[name]["step_error_vs_train"] = (
                    entry[name]["step_time_s"] / train["step_time_s"] - 1)
    suite.save()


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
        entry.update(failure(code, log))
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
        entry.update(failure(first, log1) if first else failure(second, log2))
    suite.result["fp16_resume"] = entry
    suite.save()


def serving_stage(suite: Suite, device: str, name: str, *extra: str) -> None:
    serving_json = suite.work / f"{name}.json"
    suite.log(f"serving benchmark {' '.join(extra)}")
    flags = (["--quick"] if suite.dry_run else
             ["--workload", "textlm", "--rounds", "1", "--warmup-s", "2", "--window-s", "4"])
    code, log = suite.run(name, [sys.executable, "benchmarks/serving.py", "--device", device,
                                 *flags, *extra, "--out", str(serving_json)], 120)
    suite.result[name] = (json.loads(serving_json.read_text()) if code == 0
                          else failure(code, log))
    suite.save()


def generation_stage(suite: Suite, device: str, name: str, *extra: str) -> None:
    """Output tokens/s of the generation engine, of /v1/predict's no-cache loop and, where
    installed, of vLLM on the same weights: textlm 124m, up to 64 clients, on a GPU."""
    generation_json = suite.work / f"{name}.json"
    suite.log(f"generation benchmark {' '.join(extra)}")
    # The dry run walks the stage with the engine alone; test_generate's quick run covers the
    # Hugging Face export, whose server would add ~15 s here. llama.cpp, a CPU contender,
    # is the CPU benchmark's (generation.py --model textlm): vLLM is the GPU's.
    flags = (["--model", "textlm", "--quick", "--no-hf", "--no-llama-cpp"] if suite.dry_run
             else ["--model", "textlm", "--precision", "bf16", "--no-transformers",
                   "--no-llama-cpp", "--no-hf", "--model-size", "124m",
                   "--concurrency", "1,8,32,64", "--max-batch-size", "64", "--rounds", "1",
                   "--warmup-s", "2", "--window-s", "3"])
    limit = 120 if suite.dry_run else 360 if "--cuda-graphs" in extra else 240
    code, log = suite.run(name, [sys.executable, "benchmarks/generation.py", "--device", device,
                                 *flags, *extra, "--out", str(generation_json)], limit)
    if code != 0:
        suite.result[name] = failure(code, log)
    else:
        result = json.loads(generation_json.read_text())
        suite.result[name] = {
            "gpuflow_runs_on": result["gpuflow_runs_on"], "settings": result["settings"],
            "tokens_per_s": {contender: {level: figures["tokens_per_s"]
                                         for level, figures in by_level.items()}
                             for contender, by_level in result["runs"].items()},
            "runs": result["runs"], "notes": result["notes"]}
    suite.save()


def generation_real_stage(suite: Suite, device: str) -> None:
    """Issue 50's stage: the engine on SmolLM2-135M-Instruct and a 1B Llama config in bf16,
    1 to 256 clients (the dry run: one tiny model on the CPU, 1 and 2 clients). On a GPU the
    script's own results file is kept in benchmarks/results too."""
    import gpu_generation

    work = suite.work / "generation-real"
    out = gpu_generation.default_out(suite.dry_run, work)
    budget = max(60.0, min(GENERATION_REAL_BUDGET_S, suite.left_s() - 60))
    flags = ["--dry-run"] if suite.dry_run else ["--budget-s", f"{budget:.0f}"]
    suite.log("generation, SmolLM2-135M-Instruct and the 1B Llama config")
    code, log = suite.run("generation-real", [
        sys.executable, "benchmarks/gpu_generation.py", "--device", device, *flags,
        "--workdir", str(work), "--out", str(out)], 120 if suite.dry_run else budget + 90)
    # Rewritten after every window: a run stopped at its limit still left its figures.
    if out.is_file():
        result = json.loads(out.read_text())
        suite.result["generation_real"] = {
            "exit_code": code, "results_file": str(out),
            **{key: result.get(key) for key in ("dry_run", "settings", "models", "verdicts",
                                                "table", "notes", "wall_time_s")}}
        if code != 0:
            suite.result["generation_real"]["log_tail"] = tail(log)
    else:
        suite.result["generation_real"] = failure(code, log)
    suite.save()


def compare_stage(suite: Suite, device: str) -> None:
    compare_json = suite.work / "compare_trainers.json"
    suite.log("compare_trainers")
    flags = (["--models", "linear", "--rounds", "2", "--warmup-rounds", "1",
              "--round-seconds", "0.02", "--memory-repeats", "1"] if suite.dry_run
             else ["--models", "transformer", "--rounds", "10", "--memory-repeats", "1"])
    code, log = suite.run("compare_trainers", [sys.executable, "benchmarks/compare_trainers.py",
                                               "--device", device, *flags,
                                               "--out", str(compare_json)], 150)
    if code != 0:
        suite.result["compare_trainers"] = failure(code, log)
    else:
        result = json.loads(compare_json.read_text())
        suite.result["compare_trainers"] = {
            "skipped": result["skipped"], "table": result["table"],
            "verdicts": result["verdicts"], "versions": result["versions"],
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
        100)
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
        entry.update(failure(code, log))
    suite.result["fsdp_comm"] = entry
    suite.save()


def gpu_machine() -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "gpu_count": torch.cuda.device_count(),
            "nvidia_smi": smi and subprocess.run(
                [smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()}


def default_out(dry_run: bool, partial: bool, work: Path) -> Path:
    """The full run's file per GPU model; a partial run's beside it; a dry run's in the
    scratch folder (it measures nothing worth keeping)."""
    if dry_run:
        return work / "gpu_suite-dry-run.json"
    slug = _common.gpu_slug() or "no-gpu"
    return _common.RESULTS_DIR / f"gpu_suite-{slug}{'-partial' if partial else ''}.json"


def report(result: dict[str, Any]) -> None:
    for entry in [*result.get("train", []), *result.get("cuda_graphs", [])]:
        if not entry.get("step_time_s"):
            print(f"textlm {entry['label']}: not measured: "
                  + (entry.get("refused") or f"exit {entry.get('exit_code')}"))
            continue
        mfu = "n/a" if entry["mfu"] is None else f"{100 * entry['mfu']:.1f}%"
        print(f"textlm {entry['label']}: {entry['tokens_per_s']:,.0f} tokens/s, MFU {mfu} "
              f"(against the bf16 peak), step {entry['step_time_s']:.4f} s")
    for name, verdict in result.get("verdicts", {}).items():
        print(f"{name}: {json.dumps(verdict)}")
    for name in ("serving", "serving_cuda_graphs"):
        runs_of = result.get(name, {}).get("runs")
        if runs_of:
            print(f"{name}: " + ", ".join(f"{config} {figures['requests_per_s']:.1f} req/s"
                                          for config, figures in runs_of.items()))
    for name in ("generation", "generation_cuda_graphs"):
        figures = result.get(name, {}).get("tokens_per_s", {}).get("gpuflow")
        if figures:
            print(f"{name}: /v1/completions output tokens/s " + ", ".join(
                f"c{level} {value:.0f}" for level, value in figures.items()))
    for line in result.get("generation_real", {}).get("table") or []:
        print(f"generation-real {line}")
    for verdict in result.get("compare_trainers", {}).get("verdicts", []):
        print(f"compare_trainers {verdict}")
    if result.get("skipped"):
        print(f"skipped for the budget: {', '.join(result['skipped'])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="every stage on the CPU at tiny sizes (checks the script)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default benchmarks/results/gpu_suite-<gpu>[-partial].json")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: temp)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="start no stage after this many seconds (default "
                             f"{DEFAULT_BUDGET_S}: the suite ends within 8 minutes)")
    parser.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                        help=f"comma-separated subset of {','.join(STAGES)} "
                             f"(default {','.join(DEFAULT_STAGES)})")
    parser.add_argument("--runs", default=None,
                        help="comma-separated training run labels, e.g. 124m-bf16 (default all)")
    args = parser.parse_args()
    stages = chosen_stages(parser, args.stages, STAGES)
    partial = stages != list(DEFAULT_STAGES) or args.runs is not None
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpuflow-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GPUFLOW_CACHE_DIR", str(work / "cache"))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, str(ROOT / "src"))
    suite = Suite(args.dry_run, args.out or default_out(args.dry_run, partial, work), work,
                  args.budget_s)
    device = "cpu" if args.dry_run else "cuda"
    runs = train_runs(args.dry_run)
    runs = ([run for run in runs if run.label in args.runs.split(",")] if args.runs
            else [run for run in runs if not run.lever])
    package = _common.package_version
    suite.result = {
        "benchmark": "gpu_suite",
        **_common.provenance(cuda=torch.version.cuda, torchao=package("torchao"),
                             lightning=package("lightning"),
                             accelerate=package("accelerate")),
        "dry_run": args.dry_run,
        "partial": partial,
        "selection": {"stages": stages, "runs": [run.label for run in runs],
                      "budget_s": args.budget_s},
        "machine": {**_common.machine_info(), **gpu_machine()},
        "targets": TARGETS,
    }
    suite.save()
    if "matmul" in stages:
        suite.log(f"matmul peak probe on {device}")
        suite.result["matmul"] = matmul_probe(torch.device(device),
                                              [256] if args.dry_run else [4096, 8192, 16384])
        suite.save()
    if "train" in stages:
        train_stage(suite, "train", runs, device, limit_s=150)
    if "generation" in stages:
        # On a GPU vLLM is measured once, beside gpuflow's fastest decode (CUDA graphs).
        generation_stage(suite, device, "generation", *(["--no-vllm"] if device == "cuda"
                                                         else []))
        if device == "cuda":
            generation_stage(suite, device, "generation_cuda_graphs", "--cuda-graphs")
    if "generation-real" in stages:
        generation_real_stage(suite, device)
    if "cuda-graphs" in stages:
        train_stage(suite, "cuda_graphs", graph_runs(args.dry_run), device, limit_s=90)
    if "serving" in stages:
        serving_stage(suite, device, "serving")
        if device == "cuda":
            serving_stage(suite, device, "serving_cuda_graphs", "--cuda-graphs")
    if "plan" in stages:
        plan_stage(suite, device)
    if "fsdp-comm" in stages:
        fsdp_comm_stage(suite, device, DRY_MODEL if args.dry_run else "124m")
    if "compare" in stages:
        compare_stage(suite, device)
    if "batch-auto" in stages:
        batch_size_auto_stage(suite, device, DRY_MODEL if args.dry_run else "124m",
                              8 if args.dry_run else 1024)
    if "fp16-resume" in stages:
        paths_stage(suite, device)
    suite.result["verdicts"] = judge(suite.result)
    suite.save()
    report(suite.result)
    print(f"wall {suite.result['wall_time_s']:.0f} s; results in {suite.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
