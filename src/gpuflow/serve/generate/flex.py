"""Paged decode attention through FlexAttention: each row reads the blocks it holds, not
the whole context's width.

``decode_attention`` (``attention``) keeps a compiled, CUDA-graph-captured decode step's
shapes static by gathering every block a padded table names: for a model with an 8k-128k
context that reads 100-1000 times the keys a short row holds. Here the static shapes are
the block mask's, not the keys': FlexAttention's kernels take per-row lists of KV blocks
and their counts as device tensors, so a captured step reads what the rows hold. The CPU
keeps ``decode_attention``: there flex is torch's eager reference or inductor's C++
template, used for checks.

Layout. Each decode row is its own batch element (``q [B, heads, 1, dim]``), and the keys
and values are the layer's whole pool seen as one sequence ``[1, kv_heads, num_blocks *
block_size, dim]`` (a view, nothing copied; flex broadcasts one KV batch over the rows),
so a key's flex index is its physical slot. The mask's KV block is the pool's block, and
row ``b``'s list is ``block_tables[b, first:positions[b] // block_size + 1]`` (``first``
the window's first block, else 0): one mask row per decode row, which is what makes the
sparsity per row (vLLM's flex backend lays all tokens out as one query sequence in
16-token query blocks, so 16 decode rows share one list, the union of their blocks).
Every block is listed as partial, none as full: with full blocks ``flex_decoding`` splits
each row's work by the pool's length (``KV_LEN / SPLIT_KV``), not the row's. The lists
are built with ``BlockMask.from_kv_blocks`` from device tensors alone (a gather and
arithmetic, static shapes): no host read, so the mask is built inside a compiled,
captured step.

The ``mask_mod``. The kernels evaluate it only inside the blocks a row lists; there a
block is the row's, and only its last block (positions past ``positions[b]``) and its
window's first (positions before the window) are partial, so comparing the slot's block
with those two, read through ``block_tables[b, ...]``, gives the logical position's test:
no inverse map from slots to logical positions (torch's ``PagedAttention`` and vLLM keep
one per row, ``[B, num_blocks]`` of int64: 200 MB for 256 rows of a 100k-block pool,
written once a step). The comparison reads only ``block_tables`` and ``positions``, the
step's inputs: inductor's CPU flex template miscompiles a ``mask_mod`` that reads a
buffer computed in the same graph (torch 2.13: a scattered map is read as the zeros it
was scattered into), which an input cannot be. Torch's eager flex ignores the block lists
and evaluates ``mask_mod`` over the whole pool, so a mask built outside a compiled graph
(where no kernel will restrict it) gets the exact test instead: one inverse map
``[num_blocks]``, shared by every row (a block sits at the same logical index in every
table naming it: only the prefix cache shares blocks, under a key that names the whole
prefix), checked by ``block_tables[b, logical_of[block]] == block``.

Block sizes. Triton's ``tl.dot`` needs 16 rows or more and ``tl.arange`` a power of two,
so torch 2.13's flex kernels take a KV tile ``BLOCK_N`` that is a power of two >= 16 and
divides the mask's KV block (``flex_decoding`` clamps its config to the block and skips one
that does not divide it; the main kernel raises), and ``kernel_options`` gives the
largest such (16 for 16 or 48, up to 64). ``flex_decoding`` (one program per row and KV
head, its grouped query heads together, so each KV position is read once per KV head)
also needs the query heads per KV head to be a power of two; otherwise flex runs its
main kernel, a program per query head. A pool block that 16 does not divide
(``--block-size 8``) cannot be a mask block: a mask block of ``lcm(block_size, 16)``
would hold other sequences' blocks (the ``mask_mod`` would need the inverse map in the
graph) and read up to ``16 / gcd`` times the positions held on a fragmented pool
(``benchmarks/attention_traffic.py``: 1.98 for 8-token blocks), so ``flex_supported``
says no and the step keeps ``decode_attention``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from gpuflow.serve.generate.paged import KVPool

MASK_Q_BLOCK = 128  # one query a row: a multiple of flex_decoding's BLOCK_M (16 and up)
LEAST_TILE = 16  # the fewest KV positions a Triton tile takes (tl.dot)
WIDEST_TILE = 64  # flex_decoding's default BLOCK_N
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flex_supported(block_size: int) -> bool:
    """Whether pool blocks of ``block_size`` tokens can be flex's KV blocks (see the
    module): a multiple of 16."""
    return block_size % LEAST_TILE == 0


def flex_applies(q: torch.Tensor, pool: KVPool) -> bool:
    """Whether ``decode_attention`` should go through ``flex_decode_attention`` for ``q``
    over ``pool``: on CUDA (the CPU keeps its SDPA path), over blocks flex takes, with key
    and value widths of 16 or more (Triton's tiles; torch raises below)."""
    return (q.device.type == "cuda" and flex_supported(pool.block_size)
            and min(pool.keys.shape[-1], pool.values.shape[-1]) >= LEAST_TILE)


def kernel_options(mask: BlockMask) -> dict[str, int]:
    """``BLOCK_N`` for ``mask``: the largest power of two up to 64 dividing its KV block
    (48 positions: 16; flex's default configs would take 48, not a power of two)."""
    size = mask.BLOCK_SIZE[1]
    return {"BLOCK_N": min(WIDEST_TILE, size & -size)}


def _partial_blocks(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                    sliding_window: int | None) -> MaskMod:
    """The ``mask_mod`` for slots inside a row's listed blocks: only the last block (past
    ``positions[b]``) and, with a window, the first (before it) hide any. It reads the
    step's own ``block_tables`` and ``positions``, nothing computed from them."""
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                 kv: torch.Tensor) -> torch.Tensor:
        block, offset = kv // block_size, kv % block_size
        at = positions[b]
        last = block_tables[b, at // block_size]
        seen = (block != last) | (offset <= at % block_size)
        if sliding_window is not None:
            start = (at - sliding_window + 1).clamp(min=0)
            first = block_tables[b, start // block_size]
            seen = seen & ((block != first) | (offset >= start % block_size))
        return seen

    return mask_mod


def _any_slot(block_tables: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor,
              logical: torch.Tensor, listed: torch.Tensor, block_size: int, num_blocks: int,
              sliding_window: int | None) -> MaskMod:
    """The exact ``mask_mod`` over every pool slot, for eager flex (see the module): the
    listed blocks' logical indices scattered into one map ``[num_blocks]`` (unlisted
    columns write 0 into the null block, so every write to a block agrees)."""
    logical_of = torch.zeros(num_blocks, dtype=torch.long, device=blocks.device)
    logical_of.scatter_(0, torch.where(listed, blocks, 0).reshape(-1),
                        torch.where(listed, logical, 0).reshape(-1))

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                 kv: torch.Tensor) -> torch.Tensor:
        block = kv // block_size
        logical = logical_of[block]
        at = logical * block_size + kv % block_size
        seen = (block_tables[b, logical] == block) & (at <= positions[b])
        if sliding_window is not None:
            seen = seen & (at > positions[b] - sliding_window)
        return seen

    return mask_mod


def paged_decode_mask(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                      num_blocks: int, sliding_window: int | None = None) -> BlockMask:
    """The block mask of one decode token per row, at ``positions[B]``, over a pool of
    ``num_blocks`` blocks of ``block_size`` (a multiple of 16) seen as one sequence: row
    ``b`` lists the pool blocks ``block_tables[b, first:positions[b] // block_size + 1]``
    (``first`` 0, or its window's first block) and ``mask_mod`` hides the slots past
    ``positions[b]`` and before the window. Device tensors alone, static shapes: built
    inside a compiled, captured step."""
    if not flex_supported(block_size):
        raise ValueError(f"flex attention takes pool blocks of a multiple of {LEAST_TILE} "
                         f"tokens (got {block_size}): keep decode_attention")
    rows, width = block_tables.shape
    at = positions.long()
    first = torch.zeros_like(at)
    if sliding_window is not None:  # the window's first block
        first = (at - sliding_window + 1).clamp(min=0) // block_size
    count = at // block_size - first + 1
    columns = torch.arange(width, device=block_tables.device)
    logical = (first[:, None] + columns).clamp(max=width - 1)
    blocks = block_tables.gather(1, logical)  # each row's listed blocks, then repeats
    if torch.compiler.is_compiling():
        mask_mod = _partial_blocks(block_tables, positions, block_size, sliding_window)
    else:
        mask_mod = _any_slot(block_tables, positions, blocks, logical,
                             columns < count[:, None], block_size, num_blocks, sliding_window)
    return BlockMask.from_kv_blocks(
        count.to(torch.int32).view(rows, 1, 1), blocks.to(torch.int32)[:, None, None],
        BLOCK_SIZE=(MASK_Q_BLOCK, block_size), mask_mod=mask_mod,
        seq_lengths=(1, num_blocks * block_size), compute_q_blocks=False)


def read_positions(mask: BlockMask) -> int:
    """The KV positions a kernel reads for ``mask``, per KV head: every row's listed
    blocks (partial and full) times the mask's KV block. Reads the device (for measuring,
    not for a step)."""
    blocks = mask.kv_num_blocks.sum()
    if mask.full_kv_num_blocks is not None:
        blocks = blocks + mask.full_kv_num_blocks.sum()
    return int(blocks) * mask.BLOCK_SIZE[1] // mask.kv_num_blocks.shape[1]


@cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """Flex compiled once, for a call outside a compiled graph on an accelerator:
    uncompiled flex is the reference that scores the whole pool."""
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def flex_decode_attention(q: torch.Tensor, pool: KVPool, layer: int, positions: torch.Tensor,
                          block_tables: torch.Tensor, scale: float | None = None,
                          sliding_window: int | None = None, *,
                          mask: BlockMask | None = None) -> torch.Tensor:
    """``decode_attention``'s contract through FlexAttention: one token per row,
    ``q[B, heads, head_dim]`` at ``positions[B]`` over the blocks ``block_tables[B, M]``
    names, grouped-query heads included; returns ``[B, heads, value_dim]`` in ``q``'s
    dtype. The kernel reads the blocks each row holds (``paged_decode_mask``; ``mask``
    passes one built once a step for every layer of the same window). Keys and values
    stay in the pool's dtype (the Triton kernels cast each tile to ``q``'s).

    In a compiled graph flex is lowered with the step; called eagerly on an accelerator
    it runs compiled on its own; on the CPU, eagerly, torch's reference scores every pool
    slot (for checks, not serving)."""
    if mask is None:
        mask = paged_decode_mask(block_tables, positions, pool.block_size, pool.num_blocks,
                                 sliding_window)

    def whole(tensor: torch.Tensor) -> torch.Tensor:  # [1, kv_heads, num_blocks * size, dim]
        return tensor[layer].flatten(0, 1).transpose(0, 1)[None]

    keys, values = whole(pool.keys), whole(pool.values)
    run = flex_attention
    if q.device.type != "cpu" and not torch.compiler.is_compiling():
        run = _compiled_flex()
    out = run(q[:, :, None], keys, values, block_mask=mask, scale=scale,
              enable_gqa=q.shape[1] != keys.shape[1], kernel_options=kernel_options(mask))
    return out[:, :, 0]
