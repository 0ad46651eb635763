"""How many KV blocks the pool holds: its memory budget over one block's share."""

from __future__ import annotations

import torch

from gpuflow.devices import total_memory
from gpuflow.errors import UserError
from gpuflow.serve.generate.blocks import blocks_for


def pool_blocks(bytes_per_block: int, budget_bytes: int, block_size: int, context: int,
                max_seqs: int) -> int:
    """Blocks of the pool, the null block among them: as many as ``budget_bytes`` allows, at
    most what ``max_seqs`` sequences of the whole ``context`` fill (more would never be
    used), and at least one whole context's (a sequence the pool cannot hold alone would
    be preempted for ever)."""
    per_context = blocks_for(context, block_size)
    blocks = min(budget_bytes // bytes_per_block, max_seqs * per_context + 1)
    if blocks < per_context + 1:
        need = (per_context + 1) * bytes_per_block
        raise UserError(
            f"The KV cache budget ({budget_bytes / 2**30:.3g} GiB) cannot hold one sequence "
            f"of this model's context ({context} tokens: {per_context} blocks of "
            f"{block_size} and the null block, {need / 2**20:.1f} MiB); raise "
            "--kv-cache-gib or lower --max-model-len.")
    return blocks


def default_cache_budget(device: torch.device) -> int:
    """Half the device's free memory, or a quarter of a CPU's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return (total_memory() or 8 << 30) // 4
