"""Who this process is in a distributed job, from torchrun's or Slurm's environment."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

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
        torch.set_num_threads(max(1, usable_cores() // found.local_world_size))
    return found


def usable_cores() -> int:
    """Cores this process may run on (a container or `taskset` can allow fewer than exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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
