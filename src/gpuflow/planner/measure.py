"""``gpuflow plan --measure``: calibrate the hardware description on the machine at hand.

It measures only what the machine can say about the ``--gpu-type`` planned for, so it refuses
to run anywhere but on such a GPU (a CPU's matmul rate over an H100's datasheet peak is no
efficiency of an H100). Compute: the efficiency is the MFU of a short training run of the
real model (``gpuflow.train.calibrate``). Links: where two GPUs are visible, two local
processes all-reduce two message sizes over nccl and the alpha-beta model is solved from the
two timings; with one GPU the datasheet's link stays.
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

from gpuflow.errors import UserError
from gpuflow.parallel.env import free_port
from gpuflow.planner.machine import Hardware, Link, gpu_type_of

SIZES = (1 << 16, 1 << 24)
REPEATS = 5


def check_measurable(gpu_type: str) -> str:
    """This machine's GPU name when it is a ``gpu_type``; otherwise refuse, saying why."""
    fallback = ("Run it on the GPU type planned for, or plan without --measure, giving "
                "--efficiency (the MFU of a `gpuflow train` run on that GPU) or keeping the "
                "documented default")
    if not torch.cuda.is_available():
        raise UserError(
            "plan --measure calibrates the plan by training the model on this machine, which "
            f"has no GPU: a CPU's rate says nothing about --gpu-type {gpu_type}. {fallback}.")
    name = torch.cuda.get_device_name()
    here = gpu_type_of(name)
    if here != gpu_type.lower():
        other = (f"plan for it with --gpu-type {here}" if here else
                 "the planner has no figures for it")
        raise UserError(
            f"plan --measure measures this machine's {name}, not the --gpu-type {gpu_type} "
            f"planned for ({other}). {fallback}.")
    return name


def _allreduce_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=2)
    device = torch.device("cuda", rank)
    timings = []
    for size in SIZES:
        tensor = torch.ones(size // 4, device=device)
        dist.all_reduce(tensor)
        best = float("inf")
        for _ in range(REPEATS):
            dist.barrier()
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(tensor)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        timings.append(best)
    if rank == 0:
        Path(out).write_text(" ".join(map(str, timings)))
    dist.destroy_process_group()


def measure_link(name: str = "measured") -> Link:
    """Alpha-beta of a 2-process all-reduce over nccl between the first two GPUs:
    t = 2 alpha + S / B for 2 ranks."""
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "timings")
        mp.spawn(_allreduce_worker, args=(free_port(), out), nprocs=2)
        small, large = map(float, Path(out).read_text().split())
    bandwidth = (SIZES[1] - SIZES[0]) / max(large - small, 1e-9)
    alpha = max(0.0, (small - SIZES[0] / bandwidth) / 2)
    return Link(name, bandwidth, alpha,
                "measured: nccl all-reduce between 2 local processes "
                f"({SIZES[0]} and {SIZES[1]} bytes)")


def calibrate(hardware: Hardware, efficiency: float, efficiency_source: str
              ) -> tuple[Hardware, list[str]]:
    """The hardware with the measured efficiency and, given two GPUs, the measured intra-node
    link; notes on what was done."""
    hardware = replace(hardware, efficiency=efficiency, efficiency_source=efficiency_source)
    notes = [f"compute efficiency {efficiency_source}"]
    if torch.cuda.device_count() < 2:
        notes.append(f"one GPU here: no link to measure, {hardware.intra.name} kept "
                     f"({hardware.intra.source})")
        return hardware, notes
    link = measure_link()
    notes.append(f"link {link.bandwidth / 1e9:.2f} GB/s, alpha {link.latency_s * 1e6:.0f} us "
                 f"({link.source})")
    return replace(hardware, intra=link), notes
