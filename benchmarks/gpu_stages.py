"""The GPU stages of ``gpu_suite.sh --pending``, in the fixed order a GPU window runs them.

Each stage names the code it measures (git paths: a commit there after its measurement makes
it stale), where its results land (a glob in ``benchmarks/results`` and a test that a file
there holds this stage's figures, not a dry run's or a failure's), the command that measures
it, a time estimate, and its headline figures for docs/performance.md's table. The stages
never measured on a GPU come first, so that a short window goes to them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Result = dict[str, Any]
# What the training stages run on: a change here can move every training figure.
TRAIN = ("src/gpuflow/train", "src/gpuflow/parallel", "src/gpuflow/precision.py",
         "src/gpuflow/telemetry")
TEXTLM = (*TRAIN, "src/gpuflow/models/gpt.py", "src/gpuflow/workloads/textlm.py")
IMAGES = (*TRAIN, "src/gpuflow/data", "src/gpuflow/models/resnet.py",
          "src/gpuflow/workloads/images.py", "src/gpuflow/workloads/images_codec.py")


@dataclass(frozen=True)
class Stage:
    """One measurement the queue can run; ``command(gpu, left_s)`` is the script and its
    arguments (run with the queue's interpreter from the repository root)."""

    name: str
    about: str
    sources: tuple[str, ...]
    results: str
    holds: Callable[[Result], bool]
    command: Callable[[str, float], list[str]]
    estimate_s: float
    headline: Callable[[Result], str]


def _suite(stages: str, name: str, *extra: str) -> Callable[[str, float], list[str]]:
    """gpu_suite.py with chosen stages, its file named after the GPU and the queue stage."""
    return lambda gpu, left_s: [
        "benchmarks/gpu_suite.py", "--stages", stages, *extra, "--budget-s", f"{left_s:.0f}",
        "--out", f"benchmarks/results/gpu_suite-{gpu}-{name}.json"]


def _script(script: str, name: str, *extra: str) -> Callable[[str, float], list[str]]:
    return lambda gpu, left_s: [f"benchmarks/{script}.py", *extra,
                                "--out", f"benchmarks/results/{script}-{gpu}-{name}.json"]


def _run(result: Result, key: str, label: str) -> Result:
    """A measured run of a gpu_suite list (train, cuda_graphs), else an empty one."""
    return next((run for run in result.get(key, []) if run.get("label") == label
                 and run.get("step_time_s")), {})


def _ratio(top: float | None, bottom: float | None) -> str:
    return f"{top / bottom:.2f}x" if top and bottom else "n/a"


def _tokens(result: Result, key: str, level: str) -> float | None:
    return ((result.get(key) or {}).get("tokens_per_s") or {}).get("gpuflow", {}).get(level)


def _graphed_decode(result: Result) -> bool:
    """The CUDA-graph run decoded with graphs: a run that fell back to eager measured nothing."""
    runs_on = (result.get("generation_cuda_graphs") or {}).get("gpuflow_runs_on") or {}
    return "with CUDA graphs" in runs_on.get("decode", "")


def _generation(result: Result) -> str:
    return ", ".join(
        f"c{level} {_tokens(result, 'generation', level) or 0:,.0f} eager, "
        f"{_tokens(result, 'generation_cuda_graphs', level) or 0:,.0f} graphed tok/s"
        for level in ("1", "64"))


def _real_level(result: Result, model: str, clients: str, figure: str) -> str:
    value = (result.get("models", {}).get(model, {}).get("levels", {}).get(clients, {})
             .get(figure))
    return "n/a" if value is None else f"{value:,.1f}"


def _generation_real(result: Result) -> str:
    return (f"SmolLM2 ITL p50 c1 {_real_level(result, 'smollm2', '1', 'itl_p50_ms')} ms, "
            f"{_real_level(result, 'smollm2', '256', 'tokens_per_s')} tok/s c256; 1B "
            f"{_real_level(result, 'llama-1b', '1', 'tokens_per_s')} tok/s c1, "
            f"{_real_level(result, 'llama-1b', '256', 'tokens_per_s')} c256")


def _fp8(size: str) -> Callable[[Result], str]:
    def headline(result: Result) -> str:
        bf16, fp8 = _run(result, "train", f"{size}-bf16"), _run(result, "train", f"{size}-fp8")
        losses = [run.get("final_metrics", {}).get("val_loss") for run in (fp8, bf16)]
        return (f"bf16 MFU {100 * (bf16.get('mfu') or 0):.1f}%; fp8 "
                f"{_ratio(fp8.get('tokens_per_s'), bf16.get('tokens_per_s'))} bf16's tokens/s, "
                f"validation loss {_ratio(*losses)} bf16's")
    return headline


def _measured_train(size: str) -> Callable[[Result], bool]:
    return lambda result: all(_run(result, "train", f"{size}-{precision}")
                              for precision in ("bf16", "fp8"))


def _lever(name: str, precision: str) -> Callable[[Result], str]:
    """The run with lever ``name`` switched against today's step, per model size."""
    def headline(result: Result) -> str:
        parts = []
        for size in ("124m", "1b"):
            today, lever = (_run(result, "train", f"{size}-{precision}{suffix}")
                            for suffix in ("", f"-{name}"))
            if lever:
                ratio = _ratio(lever["tokens_per_s"], today.get("tokens_per_s"))
                parts.append(f"{size}: {name} {ratio} today's tokens/s, peak memory "
                             f"{_gib(lever)} against {_gib(today)} GiB")
        return "; ".join(parts)
    return headline


def _gib(run: Result) -> str:
    return f"{run['peak_mem_bytes'] / 2**30:.1f}" if run.get("peak_mem_bytes") else "n/a"


def _measured_lever(name: str, precision: str, sizes: tuple[str, ...]
                    ) -> Callable[[Result], bool]:
    return lambda result: all(_run(result, "train", label) for size in sizes
                              for label in (f"{size}-{precision}", f"{size}-{precision}-{name}"))


def _lever_stage(stage: str, name: str, about: str, sources: tuple[str, ...],
                 precision: str = "bf16", sizes: tuple[str, ...] = ("124m", "1b")) -> Stage:
    """textlm at ``sizes`` in ``precision``, compiled, today's step and the gpu_suite runs
    with lever ``name`` switched (``gpu_suite.lever_runs``)."""
    runs = ",".join(f"{size}-{precision}{suffix}" for size in sizes
                    for suffix in ("", f"-{name}"))
    return Stage(stage, f"textlm {' and '.join(sizes)} in {precision}, compiled: {about}",
                 (*TEXTLM, "src/gpuflow/config_fields.py", *sources), "gpu_suite-*.json",
                 _measured_lever(name, precision, sizes), _suite("train", stage, "--runs", runs),
                 150 * len(sizes), _lever(name, precision))


def _images(result: Result) -> str:
    ratios = result.get("over_synthetic") or {}
    return ", ".join(f"{name.removeprefix('jpeg_')} {_ratio(value, 1.0)} synthetic's images/s"
                     for name, value in ratios.items())


def _finetune(result: Result) -> str:
    run = result.get("finetune", {})
    return f"{run.get('tokens_per_s') or 0:,.0f} tokens/s, MFU {100 * (run.get('mfu') or 0):.1f}%"


def _lora_memory(result: Result) -> str:
    return (f"LoRA {result['lora_over_full_peak_memory_median']:.2f}x the full fine-tune's "
            f"peak memory and {result['lora_over_full_tokens_per_s_median']:.2f}x its tokens/s; "
            f"QLoRA {result['qlora_over_full_peak_memory_median']:.2f}x its peak memory")


def _asr(result: Result) -> str:
    run = result.get("asr", {})
    return (f"WER {run.get('val_wer')}, {run.get('audio_s_per_s') or 0:,.0f} audio s/s")


def _structured(result: Result) -> str:
    cost, ttft = result["cost"], result["ttft"]
    mask = cost["grammar_mask"]
    per_step = 1000 * mask["sum_s"] / mask["steps"] if mask["steps"] else 0.0
    return (f"half constrained at {cost['ratio_median']:.2f}x the tok/s; TTFT "
            f"+{ttft['cached_added_ms']:.2f} ms cached schema, +{ttft['new_added_ms']:.2f} ms "
            f"new; mask {per_step:.2f} ms a step")


def _serving(result: Result) -> str:
    return "; ".join(
        f"{name}: {runs['dynamic']['requests_per_s']:.0f} req/s dynamic, "
        f"{runs['max_batch_size_1']['requests_per_s']:.0f} at batch 1"
        for name in ("serving", "serving_cuda_graphs")
        if {"dynamic", "max_batch_size_1"} <= set(runs := (result.get(name) or {}).get("runs")
                                                  or {}))


def _plan(result: Result) -> str:
    plan = result.get("plan", {})
    return ", ".join(f"{name} efficiency: step {100 * plan[name]['step_error_vs_train']:+.0f}% "
                     "vs measured" for name in ("default", "measured")
                     if "step_error_vs_train" in plan.get(name, {}))


def _fsdp(result: Result) -> str:
    comm, step = (sorted(result["fsdp_comm"][key]) for key in ("comm_s", "step_time_s"))
    return (f"exposed communication {1000 * comm[len(comm) // 2]:.0f} ms of a "
            f"{1000 * step[len(step) // 2]:.0f} ms step (medians)")


def _graphs(result: Result) -> str:
    off, on = (_run(result, "cuda_graphs", label) for label in ("graphs-off", "graphs-on"))
    return f"{_ratio(off.get('step_time_s'), on.get('step_time_s'))} the steps/s with graphs"


def _on_gpu(result: Result) -> bool:
    """A run on one of the GPUs lent to this project (a CPU's run names its processor)."""
    return "NVIDIA" in str(result.get("device_name"))


def _has(*path: str) -> Callable[[Result], bool]:
    """A gpu_suite file holds this key path with a value (a failed stage holds an error)."""
    def holds(result: Result) -> bool:
        value: Any = result
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return bool(value)
    return holds


STAGES: tuple[Stage, ...] = (
    Stage("generation", "CUDA-graph decode: the generation engine, textlm 124m, eager against "
          "graphed", ("src/gpuflow/serve", "benchmarks/generation.py"), "gpu_suite-*.json",
          _graphed_decode, _suite("generation", "generation"), 330, _generation),
    Stage("generation-real", "the engine on SmolLM2-135M and a 1B Llama config, 1-256 clients",
          ("src/gpuflow/serve", "src/gpuflow/hf.py", "benchmarks/gpu_generation.py"),
          "gpu_generation-*.json", _has("models", "llama-1b", "levels"),
          lambda gpu, left_s: ["benchmarks/gpu_generation.py", "--budget-s",
                               f"{max(60.0, left_s - 90):.0f}"], 390, _generation_real),
    Stage("fp8-1b", "textlm 1b, fp8 (torchao) against bf16, compiled",
          (*TEXTLM, "src/gpuflow/lazy_torchao.py"), "gpu_suite-*.json", _measured_train("1b"),
          _suite("train", "fp8-1b", "--runs", "1b-bf16,1b-fp8"), 150, _fp8("1b")),
    Stage("images", "JPEG decode on the CPU and on the GPU feeding ResNet-50, against "
          "synthetic images", (*IMAGES, "benchmarks/gpu_images.py", "benchmarks/image_loader.py"),
          "gpu_images-*.json", _has("over_synthetic", "jpeg_cpu_decode"),
          _script("gpu_images", "images"), 300, _images),
    Stage("finetune", "fine-tuning a ~1B Llama config (--workload hf:DIR, FSDP, compiled)",
          (*TRAIN, "src/gpuflow/hf.py", "src/gpuflow/workloads/hf_dir.py",
           "benchmarks/gpu_workloads.py"), "gpu_workloads-*.json", _has("finetune", "ok"),
          _script("gpu_workloads", "finetune", "--stages", "finetune"), 400, _finetune),
    Stage("asr", "connected-digit ASR (CTC, duration buckets), WER and audio seconds/s",
          (*TRAIN, "src/gpuflow/models/asr.py", "src/gpuflow/workloads/asr*.py",
           "src/gpuflow/data/duration_buckets.py", "src/gpuflow/data/audio.py",
           "benchmarks/gpu_workloads.py"), "gpu_workloads-*.json", _has("asr", "ok"),
          _script("gpu_workloads", "asr", "--stages", "asr"), 300, _asr),
    Stage("fashion", "Fashion-MNIST from JPEG folders, ResNet-18: validation accuracy "
          "(target 93%)", (*IMAGES, "benchmarks/fashion_images.py",
                           "scripts/fashion_mnist_jpeg.py"),
          "fashion_images-*.json", _on_gpu,
          lambda gpu, left_s: ["benchmarks/fashion_images.py", "--out",
                               f"benchmarks/results/fashion_images-{gpu}.json"], 420,
          lambda result: f"validation accuracy {100 * result['val_accuracy']:.2f}%"),
    Stage("structured-output", "32 streaming clients, half constrained by a JSON schema, "
          "against none (the stub Llama, the engine in its own process); schema TTFTs",
          ("src/gpuflow/serve", "benchmarks/structured_output.py"), "structured_output-*.json",
          lambda result: _on_gpu(result) and bool(result.get("cost")),
          _script("structured_output", "structured-output", "--device", "cuda",
                  "--engine-process"), 300, _structured),
    _lever_stage("adamw-fused", "foreach", "today's fused AdamW against --optimizer-impl "
                 "foreach", ("src/gpuflow/train/optim.py",)),
    _lever_stage("loss-chunks", "chunked", "today's loss against --loss-chunks 8 (no whole "
                 "fp32 logits)", ("src/gpuflow/train/chunked_loss.py",)),
    _lever_stage("compile-model", "whole", "today's per-block compile against "
                 "--compile-scope model (one graph)", ("src/gpuflow/train/compile.py",)),
    _lever_stage("fp8-filter", "all", "torchao's size thresholds (today) against "
                 "--fp8-min-features 0 (every layer fp8 can run)",
                 ("src/gpuflow/train/fp8.py", "src/gpuflow/lazy_torchao.py"), "fp8", ("124m",)),
    Stage("lora-serving", "8 LoRA adapters mixed against the base alone: SmolLM2-135M, bf16, "
          "32 clients", ("src/gpuflow/serve", "benchmarks/lora_serving.py"),
          "lora_serving-*.json", _on_gpu,
          _script("lora_serving", "lora-serving", "--device", "cuda", "--precision", "bf16"),
          420, lambda result: f"8 adapters mixed at {result['ratio_median']:.2f}x the base's "
                              f"{result['tokens_per_s']['base']:,.0f} tok/s"),
    Stage("lora-memory", "LoRA and QLoRA (rank 16, all linear layers) against the full "
          "fine-tune of a ~1B Llama config in bf16: peak memory and tokens/s",
          (*TRAIN, "src/gpuflow/lora.py", "src/gpuflow/nf4.py", "src/gpuflow/workloads/hf_dir.py",
           "benchmarks/lora_memory.py"), "lora_memory-*.json", _on_gpu,
          _script("lora_memory", "lora-memory", "--device", "cuda", "--dim", "2048", "--layers",
                  "22", "--seq", "1024", "--batch", "4", "--steps", "12"), 420, _lora_memory),
    Stage("train-124m", "textlm 124m in bf16 and fp8, compiled: MFU", TEXTLM, "gpu_suite-*.json",
          _measured_train("124m"), _suite("train", "train-124m", "--runs", "124m-bf16,124m-fp8"),
          150, _fp8("124m")),
    Stage("cuda-graphs", "a launch-bound textlm (tiny, micro-batch 16), compiled, then with "
          "--cuda-graphs", TEXTLM, "gpu_suite-*.json",
          lambda result: bool(_run(result, "cuda_graphs", "graphs-on")),
          _suite("cuda-graphs", "cuda-graphs"), 90,
          _graphs),
    Stage("serving", "/v1/predict with dynamic batching against batch size 1, eager and "
          "with CUDA graphs", ("src/gpuflow/serve", "benchmarks/serving.py"), "gpu_suite-*.json",
          _has("serving", "runs"), _suite("serving", "serving"), 240, _serving),
    Stage("plan", "the planner's step time for textlm 124m against the measured step",
          ("src/gpuflow/planner", "src/gpuflow/commands/plan.py"), "gpu_suite-*.json",
          _has("plan", "measured", "step_time_s"), _suite("train,plan", "plan", "--runs",
                                                          "124m-bf16"), 200, _plan),
    Stage("fsdp-comm", "FSDP's exposed communication in one process, textlm 124m", TRAIN,
          "gpu_suite-*.json", _has("fsdp_comm", "measured"), _suite("fsdp-comm", "fsdp-comm"),
          100, _fsdp),
    Stage("compare", "gpuflow against a plain loop, Fabric and Accelerate",
          (*TRAIN, "benchmarks/compare_trainers.py"), "gpu_suite-*.json",
          _has("compare_trainers", "cases"), _suite("compare", "compare"), 150,
          lambda result: "; ".join(result["compare_trainers"]["verdicts"])),
    Stage("matmul", "the best bf16 torch.mm throughput (measures the GPU, not gpuflow)", (),
          "gpu_suite-*.json", _has("matmul", "bf16_tflops"), _suite("matmul", "matmul"), 30,
          lambda result: f"{result['matmul']['bf16_tflops']:.0f} TFLOP/s"),
)


def latest(stage: Stage, results_dir: Path) -> tuple[Path, Result] | None:
    """The newest GPU measurement of ``stage`` (by its recorded date), if any."""
    found = []
    for path in sorted(results_dir.glob(stage.results)):
        result = json.loads(path.read_text())
        if not result.get("dry_run") and stage.holds(result):
            found.append((str(result.get("created", "")), path, result))
    if not found:
        return None
    _, path, result = max(found, key=lambda item: item[0])
    return path, result


def table(results_dir: Path) -> list[str]:
    """docs/performance.md's table: every GPU stage's headline figures, file and date."""
    lines = ["| stage | measures | figures | results file | date |", "|---|---|---|---|---|"]
    for stage in STAGES:
        found = latest(stage, results_dir)
        if found is None:
            lines.append(f"| `{stage.name}` | {stage.about} | never measured | | |")
            continue
        path, result = found
        lines.append(f"| `{stage.name}` | {stage.about} | {stage.headline(result)} | "
                     f"`{path.name}` | {str(result.get('created', '?'))[:10]} |")
    return lines
