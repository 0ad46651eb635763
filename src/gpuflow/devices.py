"""Device discovery and the peak FLOP/s that MFU is measured against.

On a known NVIDIA GPU the peak is the dense datasheet figure (see gpu_specs.py, with sources).
On the CPU there is no trustworthy datasheet figure, so a matrix-multiply probe measures the
best throughput torch reaches on this machine, once, and caches it. An unknown GPU has no peak:
MFU is then reported as null rather than borrowed from another card.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gpuflow.errors import UserError
from gpuflow.gpu_specs import lookup_gpu
from gpuflow.precision import compute_dtype

PROBE_SIZES = (256, 512, 1024, 2048)
PROBE_SECONDS_PER_SIZE = 0.4
# Part of the cache key: bump it when the probe's method changes, so that no machine keeps
# a peak an older method measured.
PROBE_REVISION = 2


@dataclass(frozen=True)
class PeakFlops:
    """Peak FLOP/s for one device and precision, and where the number comes from."""

    flops: float | None
    source: str


def resolve_device(spec: str) -> torch.device:
    """Turn ``auto|cpu|cuda|cuda:N`` into a device that exists here."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(
            f"--device {spec!r} is not a device; use auto, cpu, cuda or cuda:N."
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"--device {spec} asks for CUDA, but this torch build ({torch.__version__}) "
                "sees no CUDA GPU. Use --device cpu, or install a CUDA build of torch."
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise UserError(
                f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) are visible."
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise UserError(f"--device {spec!r} is not supported; use auto, cpu, cuda or cuda:N.")
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or _cpu_model() or platform.machine()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def peak_flops(device: torch.device, precision_key: str) -> PeakFlops:
    """The peak MFU is measured against, for a device and a policy's peak_key."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = lookup_gpu(name)
        if spec is None:
            warnings.warn(
                f"No datasheet peak is known for {name!r}; MFU will be reported as null.",
                stacklevel=2,
            )
            return PeakFlops(None, f"unknown GPU {name!r}: no datasheet peak")
        return PeakFlops(spec.dense_tflops[precision_key] * 1e12,
                         f"{spec.name} dense {precision_key} datasheet: {spec.source}")
    return cpu_peak(precision_key)


def cpu_peak(precision_key: str) -> PeakFlops:
    """Measured (and cached) best matmul FLOP/s of this CPU in the given precision.

    A CPU without native bf16/fp16 units can still run half-precision work at its fp32
    rate (kernels upconvert), so the half-precision peak is never taken below the fp32 one.
    """
    key = "fp32" if precision_key == "tf32" else precision_key
    threads = torch.get_num_threads()
    cache = _cache_file(key, threads)
    try:
        cached = json.loads(cache.read_text())
        return PeakFlops(float(cached["flops"]), cached["source"])
    except (OSError, ValueError, KeyError):
        pass
    flops = measure_matmul_flops(compute_dtype(key))
    source = (f"measured: best torch.mm {key} throughput on this CPU with {threads} thread(s) "
              f"(probe cached in {cache})")
    if key != "fp32":
        fp32 = cpu_peak("fp32")
        if fp32.flops is not None and fp32.flops > flops:
            flops = fp32.flops
            source = (f"measured: this CPU's fp32 torch.mm peak, above its native {key} "
                      f"matmul rate, with {threads} thread(s) (probe cached in {cache})")
    peak = PeakFlops(flops, source)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(peak)))
    tmp.replace(cache)
    return peak


def measure_matmul_flops(dtype: torch.dtype, device: torch.device | None = None) -> float:
    """Best FLOP/s of square matmuls, growing the size while one multiply stays short.

    Draws from a private generator so the probe never shifts the run's RNG streams.
    """
    device = device or torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    best = 0.0
    for n in PROBE_SIZES:
        a = torch.randn(n, n, generator=generator).to(device, dtype)
        b = torch.randn(n, n, generator=generator).to(device, dtype)
        torch.mm(a, b)
        _sync(device)
        elapsed = float("inf")
        deadline = time.perf_counter() + PROBE_SECONDS_PER_SIZE
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            _sync(device)
            elapsed = min(elapsed, time.perf_counter() - start)
        best = max(best, 2 * n**3 / elapsed)
        if elapsed > PROBE_SECONDS_PER_SIZE / 8:
            break
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_file(key: str, threads: int) -> Path:
    root = Path(os.environ.get("GPUFLOW_CACHE_DIR", Path.home() / ".cache" / "gpuflow"))
    machine = (f"{_cpu_model()}|{platform.machine()}|{torch.__version__}|{threads}|"
               f"{PROBE_SIZES}|{PROBE_REVISION}")
    digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
    return root / f"cpu-peak-{key}-{digest}.json"


def environment_report() -> dict[str, object]:
    """What `gpuflow env` prints: devices, memory and versions."""
    report: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "cpu": _cpu_model() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "memory_bytes": total_memory(),
        "gpus": [],
    }
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        spec = lookup_gpu(props.name)
        report["gpus"].append({  # type: ignore[union-attr]
            "index": index,
            "name": props.name,
            "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "peak_tflops": dict(spec.dense_tflops) if spec else None,
            "peak_source": spec.source if spec else "unknown GPU: MFU reported as null",
        })
    return report


def total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes(device: torch.device) -> int | None:
    """What one device can hold: a GPU's memory, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return total_memory()


def native_bf16(device: torch.device) -> bool | None:
    """Whether bf16 matmuls run on native units (so ``--precision bf16`` is worth
    suggesting); None when it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        return None
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))
