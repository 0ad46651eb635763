"""How many sequences the KV cache holds: its memory budget over one sequence's share."""

from __future__ import annotations

import torch

from gpuflow.devices import total_memory
from gpuflow.errors import UserError


def cache_slots(bytes_per_slot: int, budget_bytes: int, max_seqs: int, spare: int = 0) -> int:
    """Sequences the cache holds: as many as ``budget_bytes`` allows beside ``spare`` slots
    (the scratch slot of bucketed decoding), at most ``max_seqs``."""
    slots = min(max_seqs, budget_bytes // bytes_per_slot - spare)
    if slots < 1:
        beside = " beside the scratch slot that compiled decoding pads with" if spare else ""
        raise UserError(
            f"The KV cache budget ({budget_bytes / 2**30:.3g} GiB) holds no sequence of this "
            f"model{beside}, which needs {bytes_per_slot / 2**20:.1f} MiB per sequence; raise "
            "--kv-cache-gib.")
    return slots


def default_cache_budget(device: torch.device) -> int:
    """Half the device's free memory, or a quarter of a CPU's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return (total_memory() or 8 << 30) // 4
