"""Who this process is in a distributed job, from torchrun's or Slurm's environment."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gpuflow.errors import UserError


@dataclass(frozen=True)
class DistContext:
    """Rank and sizes of this process; the defaults describe a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_env(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def context_from_env() -> DistContext | None:
    """The job described by torchrun (RANK, WORLD_SIZE, ...) or Slurm (SLURM_PROCID, ...)."""
    rank = _int_env("RANK", "SLURM_PROCID")
    world = _int_env("WORLD_SIZE", "SLURM_NTASKS")
    if rank is None or world is None:
        return None
    local_rank = _int_env("LOCAL_RANK", "SLURM_LOCALID") or 0
    local_world = _int_env("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE") or world
    return DistContext(rank, world, local_rank, local_world)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(use_cuda: bool, force: bool = False) -> DistContext:
    """Join the job's process group (NCCL on CUDA, gloo on CPU).

    ``force`` starts a one-process group when no launcher is present, for strategies such
    as FSDP that need a group even on one device.
    """
    if dist.is_initialized():
        return current_context()
    found = context_from_env()
    if found is None:
        if not force:
            return DistContext()
        found = DistContext()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if "SLURM_PROCID" in os.environ and "MASTER_ADDR" not in os.environ:
        raise UserError(
            "Running under Slurm without MASTER_ADDR/MASTER_PORT: export them in the batch "
            "script (e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -1))."
        )
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(found.local_rank)
    dist.init_process_group(backend=backend, rank=found.rank, world_size=found.world_size,
                            store=_attempt_store(found.world_size))
    if not use_cuda:
        # torchrun sets OMP_NUM_THREADS=1 in every worker; the free cores are shared instead.
        set_cpu_threads(found.local_world_size)
    return found


def usable_cores() -> int:
    """Cores this process may run on (a container or `taskset` can allow fewer than exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def busy_cores(window_s: float = 0.2) -> float:
    """Cores that other processes keep busy now, from /proc/stat over ``window_s`` while
    this process sleeps (0 where /proc/stat cannot be read)."""
    def sample() -> tuple[int, int] | None:
        try:
            values = list(map(int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]))
        except (OSError, ValueError):
            return None
        idle = values[3] + values[4]
        return sum(values) - idle, sum(values)
    first = sample()
    time.sleep(window_s)
    second = sample()
    if first is None or second is None or second[1] <= first[1]:
        return 0.0
    return (os.cpu_count() or 1) * (second[0] - first[0]) / (second[1] - first[1])


def set_cpu_threads(processes_on_node: int = 1) -> str | None:
    """Give each of this node's processes an equal share of the idle cores as intra-op
    threads, and say so when other work leaves fewer than there are.

    On a CPU the OpenMP threads of one op wait for each other at every barrier: a thread
    whose core another process holds stalls them all, so one more thread than there are
    free cores makes each step slower than one thread would (measured on 2 cores with one
    busy: 131-149 ms against 118-139 ms per step of the speech workload).
    """
    cores = usable_cores()
    # Sibling ranks starting up would read as busy: a job's own processes share by count.
    busy = min(cores - 1, round(busy_cores())) if processes_on_node == 1 else 0
    threads = max(1, (cores - busy) // processes_on_node)
    torch.set_num_threads(threads)
    if busy == 0:
        return None
    return (f"{busy} of {cores} cores busy with other work: {threads} CPU thread(s) per "
            "process (set OMP_NUM_THREADS to choose)")


def _attempt_store(world_size: int) -> dist.Store | None:
    """A key space of its own for each elastic restart attempt.

    The elastic agent's store outlives a failed attempt; without a fresh prefix, restarted
    workers can read the dead attempt's addresses and fail to connect.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, is_master=False)
    return dist.PrefixStore(f"gpuflow/attempt-{attempt}", store)


def current_context() -> DistContext:
    if not (dist.is_available() and dist.is_initialized()):
        return DistContext()
    found = context_from_env()
    local_rank = found.local_rank if found else 0
    local_world = found.local_world_size if found else dist.get_world_size()
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, local_world)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
