"""Which part of the step to fix first: rules over the measured step-time breakdown.

Each rule reads the per-step medians telemetry wrote (``summary.json``'s ``median``) and the
run's settings and, when its figure crosses a threshold, names the bottleneck, the number
that shows it and the flags to try, tailored to what the run already uses. Findings are
ranked by the share of the step they put at stake, so the first one is the one to fix first.
What cannot be judged (MFU without a known peak, memory without a known capacity,
communication where it is not timed) becomes a note that says so, never a guess.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuflow.config_fields import DDP_DEFAULT_BUCKET_MIB
from gpuflow.gpu_specs import lookup_gpu

INPUT_WAIT_FRAC = 0.10
HOST_FRAC = 0.15
COMM_FRAC = 0.10
FP32_BYTES = 4  # DDP reduces gpuflow's fp32 gradients, whatever the autocast precision
MEMORY_FRAC = 0.85
LOW_MFU = 0.40
COMPUTE_DOMINANT_FRAC = 0.50

INPUT = "input-bound"
HOST = "host/launch-bound"
COMM = "communication-bound"
MEMORY = "memory-bound"
LOW_MFU_COMPUTE = "compute-bound with low MFU"


@dataclass(frozen=True)
class Finding:
    """One bottleneck: what it is, the measured figure behind it, and what to try."""

    bottleneck: str
    evidence: str
    suggestions: tuple[str, ...]
    severity: float  # the share of the step (or of memory) at stake, 0..1, for ranking


@dataclass(frozen=True)
class Diagnosis:
    """Findings, most severe first, and notes on what could not be assessed."""

    findings: tuple[Finding, ...]
    notes: tuple[str, ...]

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"


def _share(median: Mapping[str, Any], key: str) -> float | None:
    step, value = median.get("step_time_s"), median.get(key)
    if step is None or value is None or step <= 0:
        return None
    return value / step


def _memory_capacity(summary: Mapping[str, Any]) -> tuple[int | None, str]:
    """Device memory in bytes and where the figure comes from (None when unknown)."""
    if summary.get("device_memory_bytes"):
        return int(summary["device_memory_bytes"]), "recorded by the run"
    if str(summary.get("device", "")).startswith("cuda"):
        spec = lookup_gpu(str(summary.get("device_name", "")))
        if spec is not None:
            return int(spec.memory_gib * 2**30), f"{spec.name} datasheet capacity"
    return None, "unknown"


def _memory_use(summary: Mapping[str, Any]) -> float | None:
    capacity, _ = _memory_capacity(summary)
    peak = summary.get("peak_mem_bytes")
    return None if capacity is None or peak is None else peak / capacity


def _input_bound(summary: Mapping[str, Any]) -> Finding | None:
    median, config = summary["median"], summary.get("config", {})
    share = median.get("data_wait_frac")
    share = _share(median, "data_wait_s") if share is None else share
    if share is None or share < INPUT_WAIT_FRAC:
        return None
    workers = int(config.get("num_workers", 0))
    suggestions = [f"--num-workers {max(2, 2 * workers)} (now {workers}): load and collate "
                   "batches in worker processes while the step runs",
                   "cache or precompute expensive per-sample transforms"]
    if config.get("data", "real") == "real":
        suggestions.append("--data synthetic: the step time without the input pipeline, "
                           "to confirm the data is what holds the step back")
    return Finding(INPUT, f"data wait is {share:.0%} of the step "
                          f"({_ms(median['data_wait_s'])} of {_ms(median['step_time_s'])})",
                   tuple(suggestions), share)


def _pipelined(summary: Mapping[str, Any]) -> bool:
    """gpuflow does not compile pipeline stages: no compile-based suggestion applies."""
    return int(summary.get("mesh", {}).get("pp", 1)) > 1


def _compilable(summary: Mapping[str, Any]) -> bool:
    compiled = summary.get("compiled", summary.get("config", {}).get("compile", False))
    return not compiled and not _pipelined(summary)


def _host_bound(summary: Mapping[str, Any]) -> Finding | None:
    median, config = summary["median"], summary.get("config", {})
    share = _share(median, "host_s")
    if share is None or share < HOST_FRAC:
        return None
    suggestions = []
    if _compilable(summary):
        suggestions.append("--compile: fused kernels, fewer launches and less Python per step")
    if not _pipelined(summary) and str(summary.get("device", "")).startswith("cuda"):
        suggestions.append("CUDA graphs (torch.compile mode=\"reduce-overhead\"): replay the "
                           "step's kernels with one launch")
    batch = int(config.get("batch_size", 0))
    if batch:
        suggestions.append(f"a larger micro-batch (--batch-size {2 * batch}, now {batch}): "
                           "the fixed per-step cost spread over more samples")
    return Finding(HOST, f"host/other time is {share:.0%} of the step "
                         f"({_ms(median['host_s'])} of {_ms(median['step_time_s'])}) outside "
                         "data wait, compute, communication and optimizer",
                   tuple(suggestions), share)


def _comm_bound(summary: Mapping[str, Any]) -> Finding | None:
    median, config = summary["median"], summary.get("config", {})
    share = _share(median, "comm_s")
    if share is None or share < COMM_FRAC:
        return None
    strategy = summary.get("strategy")
    tp = int(summary.get("mesh", {}).get("tp", 1))
    pp = int(summary.get("mesh", {}).get("pp", 1))
    suggestions = _pipeline_suggestions(config, pp) if pp > 1 else []
    if strategy in ("ddp", "fsdp"):
        accum = int(config.get("grad_accum", 1))
        suggestions.append(f"--grad-accum {2 * accum} (now {accum}): one gradient reduction "
                           f"per {2 * accum} micro-batches")
    if strategy == "ddp":
        suggestions.append(_bucket_suggestion(summary, config))
    if strategy == "fsdp":
        per_block = config.get("fsdp_wrap", "block") == "block"
        if per_block and config.get("reshard_after_forward", True):
            suggestions.append("--no-reshard-after-forward: keep gathered parameters for "
                               "backward, one all-gather per block instead of two")
        if str(summary.get("device", "")).startswith("cuda"):
            suggestions.append(_prefetch_suggestion(config) if per_block else
                               "--fsdp-wrap block: gather each block just before it runs, "
                               "so that all-gathers overlap the blocks before")
        else:
            if per_block:
                suggestions.append("--fsdp-wrap model: the whole model one unit, one "
                                   "all-gather and one reduction per step instead of "
                                   "collectives at every block, where all ranks wait for "
                                   "each other; it holds all parameters gathered at once")
            suggestions.append("--strategy ddp if the model fits in one process's memory: "
                               "one all-reduce per gradient bucket, overlapping backward, "
                               "where FSDP's collectives cannot overlap compute on the CPU")
        if summary.get("precision") in ("fp32", "tf32"):
            suggestions.append("--precision bf16: parameters all-gathered in bf16, half "
                               "the bytes")
    if tp > 1:
        fewer = f"--tp {tp // 2}" if tp > 2 else "--strategy fsdp (or ddp) without --tp"
        suggestions.append(f"{fewer}, if the model fits: tensor parallelism exchanges "
                           "activations in every block, forward and backward, on every "
                           "micro-batch, and more data parallelism replaces it with one "
                           "gradient reduction per step")
    kinds = ((["FSDP's all-gathers and reduce-scatters"] if strategy == "fsdp" else [])
             + (["waits for tensor parallelism's collectives"] if tp > 1 else [])
             + (["pipeline stages' waits for each other's sends (its bubble with them)"]
                if pp > 1 else []))
    where = f"in {' and '.join(kinds)}" if kinds else "after backward's compute ended"
    return Finding(COMM, f"exposed communication is {share:.0%} of the step "
                         f"({_ms(median['comm_s'])} of {_ms(median['step_time_s'])}) {where}",
                   tuple(suggestions), share)


def _prefetch_suggestion(config: Mapping[str, Any]) -> str:
    depth = config.get("fsdp_prefetch")
    now = f"now {depth}" if depth else "now FSDP's own: 1, and only while the host is ahead"
    deeper = (depth or 1) + 1
    return (f"--fsdp-prefetch {deeper} ({now}): each block's forward starts the next "
            f"{deeper} blocks' all-gathers, and its backward the {deeper} before it, so a "
            "link slower than one block's compute is still hidden; holds that many more "
            "blocks gathered")


def _bucket_suggestion(summary: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    """DDP all-reduces a bucket once backward has filled it: what is still to reduce when
    backward ends is exposed, about the last bucket. Gradients that fill few buckets are
    mostly in that last one."""
    bucket = config.get("bucket_mb")
    cap = float(bucket or DDP_DEFAULT_BUCKET_MIB)
    now = f"now {cap:g}" if bucket else f"now PyTorch's {cap:g}"
    params = summary.get("trainable_params")
    gradients = FP32_BYTES * params / 2**20 if params else None
    if gradients is not None and gradients < 4 * cap:
        smaller = max(0.25, float(f"{gradients / 8:.1g}"))
        return (f"--bucket-mb {smaller:g} ({now}): the {gradients:.3g} MiB of gradients fill "
                f"{math.ceil(gradients / cap)} bucket(s), so most of the all-reduce waits "
                "for backward to end; smaller buckets start it while backward still runs")
    return (f"--bucket-mb {cap / 2:g} ({now}): about the last bucket is left to all-reduce "
            f"when backward ends, and a smaller one leaves less (--bucket-mb {2 * cap:g} "
            "instead if many small all-reduces are what costs)")


def _pipeline_suggestions(config: Mapping[str, Any], pp: int) -> list[str]:
    """A stage waits for the others through (pp - 1) of the m + pp - 1 slots of a step."""
    micro = int(config.get("microbatches") or 2 * pp)
    suggestions = [f"--microbatches {2 * micro} (now {micro}): the bubble is (pp - 1) / "
                   f"(micro-batches + pp - 1) of the step, {(pp - 1) / (micro + pp - 1):.0%} "
                   f"now, {(pp - 1) / (2 * micro + pp - 1):.0%} then"]
    if config.get("pp_schedule", "1f1b") != "interleaved-1f1b":
        suggestions.append("--pp-schedule interleaved-1f1b: two smaller stages per rank, "
                           "half the bubble")
    fewer = f"--pp {pp // 2}" if pp > 2 else "no --pp"
    suggestions.append(f"{fewer} with more data parallelism, if the model fits: fewer "
                       "stages to fill and drain")
    return suggestions


def _memory_bound(summary: Mapping[str, Any]) -> Finding | None:
    use = _memory_use(summary)
    if use is None or use < MEMORY_FRAC:
        return None
    config = summary.get("config", {})
    capacity, source = _memory_capacity(summary)
    suggestions = []
    if not summary.get("activation_checkpointing", config.get("activation_checkpointing")):
        suggestions.append("--activation-checkpointing: recompute the blocks' activations in "
                           "backward instead of keeping them")
    if summary.get("precision") in ("fp32", "tf32"):
        suggestions.append("--precision bf16: activations at half the size")
    world = int(summary.get("world_size", 1))
    if world > 1 and summary.get("strategy") != "fsdp":
        suggestions.append(f"--strategy fsdp: parameters, gradients and optimizer state "
                           f"sharded over the {world} processes")
    suggestions.append("a smaller --batch-size with a larger --grad-accum: the same global "
                       "batch in less memory")
    return Finding(MEMORY, f"peak memory {summary['peak_mem_bytes'] / 2**30:.1f} GiB is "
                           f"{use:.0%} of the device's {capacity / 2**30:.0f} GiB ({source})",
                   tuple(suggestions), use)


def _low_mfu(summary: Mapping[str, Any]) -> Finding | None:
    median, config = summary["median"], summary.get("config", {})
    mfu, share = median.get("mfu"), _share(median, "compute_s")
    if mfu is None or share is None or share < COMPUTE_DOMINANT_FRAC or mfu >= LOW_MFU:
        return None
    suggestions = []
    # Not where bf16 is emulated (a CPU without AVX512-BF16 or AMX runs it many times slower).
    if summary.get("precision") in ("fp32", "tf32") and summary.get("native_bf16") is not False:
        suggestions.append("--precision bf16: matmuls on the bf16 units (tensor cores, AMX)")
    if _compilable(summary):
        suggestions.append("--compile: fused elementwise kernels around the matmuls")
    use, batch = _memory_use(summary), int(config.get("batch_size", 0))
    if batch and (use is None or use < MEMORY_FRAC):
        headroom = "" if use is None else f"; {1 - use:.0%} of memory is free"
        suggestions.append(f"a larger micro-batch (--batch-size {2 * batch}, now {batch}): "
                           f"larger matmuls keep the units busier{headroom}")
    if summary.get("activation_checkpointing", config.get("activation_checkpointing")):
        suggestions.append("drop --activation-checkpointing if memory allows: recomputation "
                           "is work MFU does not count")
    peak = summary.get("peak_flops")
    against = "" if peak is None else f" of {peak / 1e12:.3g} TFLOP/s"
    source = summary.get("peak_flops_source", "unknown")
    return Finding(LOW_MFU_COMPUTE,
                   f"compute (forward+backward) is {share:.0%} of the step at {mfu:.1%} "
                   f"MFU{against} (peak: {source})",
                   tuple(suggestions), share * (1 - mfu))


RULES = (_input_bound, _host_bound, _comm_bound, _memory_bound, _low_mfu)


def _notes(summary: Mapping[str, Any]) -> list[str]:
    median, notes = summary["median"], []
    if median.get("mfu") is None:
        notes.append("MFU unknown: no peak FLOP/s for "
                     f"{summary.get('device_name', 'this device')} "
                     f"({summary.get('peak_flops_source', 'no source')}); compute "
                     "efficiency not assessed")
    if median.get("comm_s") is None and int(summary.get("world_size", 1)) > 1:
        notes.append(f"exposed communication is not measured under "
                     f"{summary.get('strategy', 'this strategy')}; communication-bound "
                     "cannot be ruled out")
    peak = summary.get("peak_mem_bytes")
    if peak is not None and _memory_use(summary) is None:
        notes.append(f"peak memory {peak / 2**20:,.0f} MiB "
                     f"({summary.get('peak_mem_kind', 'kind unknown')}); the device's "
                     "capacity is unknown, so memory pressure is not assessed")
    return notes


def diagnose(summary: Mapping[str, Any]) -> Diagnosis:
    """Run every rule over a summary (``summary.json``'s fields; ``median`` is required)."""
    findings = [finding for rule in RULES if (finding := rule(summary)) is not None]
    findings.sort(key=lambda finding: finding.severity, reverse=True)
    return Diagnosis(tuple(findings), tuple(_notes(summary)))


def headline(diagnosis: Diagnosis, median: Mapping[str, Any]) -> list[str]:
    """The top bottleneck and what to try, as the terminal prints it."""
    top = diagnosis.top
    if top is None:
        compute, mfu = _share(median, "compute_s"), median.get("mfu")
        where = "" if compute is None else f": compute is {compute:.0%} of the step"
        at = "" if mfu is None else f" at {mfu:.1%} MFU"
        return [f"bottleneck: none above the thresholds{where}{at}"]
    return [f"bottleneck: {top.bottleneck}: {top.evidence}",
            *(f"  try {suggestion}" for suggestion in top.suggestions)]
