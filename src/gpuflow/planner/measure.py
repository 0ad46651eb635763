"""``gpuflow plan --measure``: calibrate the hardware description on the machine at hand.

Compute: the best square-matmul throughput (``gpuflow.hardware.measure_matmul_flops``) over
the device's peak gives the efficiency. Links: two local processes all-reduce two message
sizes over gloo (nccl when two GPUs are visible) and the alpha-beta model is solved from the
two timings.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpuflow.hardware import _DTYPES, measure_matmul_flops
from gpuflow.parallel.env import free_port
from gpuflow.planner.hardware import Hardware, Link

SIZES = (1 << 16, 1 << 24)
REPEATS = 5


def measure_efficiency(hardware: Hardware, precision: str) -> float:
    """Best matmul FLOP/s here over the peak the plan assumes (capped at 1)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    measured = measure_matmul_flops(_DTYPES[precision], device)
    return min(1.0, measured / hardware.peak_flops[precision])


def _allreduce_worker(rank: int, port: int, backend: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=2)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    timings = []
    for size in SIZES:
        tensor = torch.ones(size // 4, device=device)
        dist.all_reduce(tensor)
        best = float("inf")
        for _ in range(REPEATS):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        timings.append(best)
    if rank == 0:
        Path(out).write_text(" ".join(map(str, timings)))
    dist.destroy_process_group()


def measure_link(name: str = "measured") -> Link:
    """Alpha-beta of a 2-process all-reduce: t = 2 alpha + S / B for 2 ranks."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "timings")
        mp.spawn(_allreduce_worker, args=(free_port(), backend, out), nprocs=2)
        small, large = map(float, Path(out).read_text().split())
    bandwidth = (SIZES[1] - SIZES[0]) / max(large - small, 1e-9)
    alpha = max(0.0, (small - SIZES[0] / bandwidth) / 2)
    return Link(name, bandwidth, alpha,
                f"measured: {backend} all-reduce between 2 local processes "
                f"({SIZES[0]} and {SIZES[1]} bytes)")


def calibrate(hardware: Hardware, precision: str) -> tuple[Hardware, list[str]]:
    """The hardware with measured efficiency and (intra-node) link; notes on what was done."""
    notes = []
    efficiency = measure_efficiency(hardware, precision)
    notes.append(f"compute efficiency {efficiency:.2f} of the {precision} peak (matmul probe)")
    link = measure_link()
    notes.append(f"link {link.bandwidth / 1e9:.2f} GB/s, alpha {link.latency_s * 1e6:.0f} us "
                 f"({link.source})")
    if not torch.cuda.is_available():
        notes.append("no GPU here: the link measured is gloo on the CPU, not the GPU fabric")
    return replace(hardware, efficiency=efficiency, intra=link), notes
