"""Attention over the paged KV pool (``paged.py``), as an engine step's forward calls it.

``paged_attention`` serves a ``StepBatch``: decode rows together in groups over their
gathered blocks, each prefill chunk in its own SDPA, rows sharing a long prefix through
cascade attention on the CPU. ``decode_attention`` is the static-shape variant of one
token per row (compiled decode steps, CUDA graphs), nothing read back to the host: on CUDA
through FlexAttention over exactly the blocks each row holds (``flex.py``), elsewhere every
row over every block its padded table names, under a mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.nn import functional as F

from gpuflow.serve.generate.blocks import blocks_for
from gpuflow.serve.generate.flex import flex_applies, flex_decode_attention
from gpuflow.serve.generate.paged import KVPool, StepBatch, gather, visible

GATHER_BYTES = 2 << 20  # the keys one decode SDPA gathers at most on the CPU (row_groups)


def decode_attention(q: torch.Tensor, pool: KVPool, layer: int, positions: torch.Tensor,
                     block_tables: torch.Tensor, scale: float | None = None,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one token per row, ``q[B, heads, head_dim]`` at ``positions[B]``, over
    every position ``block_tables[B, M]`` names, under a mask: shapes depend on ``B`` and
    ``M`` alone and nothing is read back to the host (for ``torch.compile(dynamic=False)``
    and CUDA graphs). Returns ``[B, heads, value_dim]``."""
    if flex_applies(q, pool):  # CUDA: read only the blocks each row holds
        return flex_decode_attention(q, pool, layer, positions, block_tables, scale,
                                     sliding_window)
    batch, width = block_tables.shape
    return _one_token_rows(q, pool, layer, positions, block_tables, [width] * batch, scale,
                           sliding_window)


def row_groups(widths: Sequence[int], block_bytes: int, device: torch.device
               ) -> list[tuple[int, int, int]]:
    """Consecutive rows as ``(first, end, blocks)`` groups whose gathered keys, each row
    padded to the group's widest table, fit ``GATHER_BYTES`` (a wider row goes alone).
    A CPU cache concern: on any other device all rows are one group (one launch)."""
    if device.type != "cpu":
        return [(0, len(widths), max(widths))]
    groups: list[tuple[int, int, int]] = []
    first, widest = 0, 0
    for row, width in enumerate(widths):
        wider = max(widest, width)
        if row > first and (row - first + 1) * wider * block_bytes > GATHER_BYTES:
            groups.append((first, row, widest))
            first, wider = row, width
        widest = wider
    groups.append((first, len(widths), widest))
    return groups


def _one_token_rows(q: torch.Tensor, pool: KVPool, layer: int, positions: torch.Tensor,
                    block_tables: torch.Tensor, widths: Sequence[int], scale: float | None,
                    sliding_window: int | None, batch: StepBatch | None = None
                    ) -> torch.Tensor:
    """Attention of one token per row over the first ``widths[b]`` blocks of each row's
    table, rows gathered in ``row_groups``: on the CPU each group's copy is read while
    still in cache, and is small enough for the allocator to reuse rather than map fresh
    pages (glibc maps buffers over 32 MiB anew at every call). On the 2-core CPU, 32 rows of
    1,008 positions, 8 heads of 32 dims: 12 ms of CPU per layer in groups of one row, 22
    to 29 ms in one SDPA (an unpaged cache read in place: 5 ms)."""
    block_bytes = math.prod(pool.keys.shape[2:]) * q.element_size()
    parts = []
    for first, end, width in row_groups(widths, block_bytes, q.device):
        keys, values = gather(pool, layer, block_tables[first:end, :width], q.dtype)
        mask = (visible(positions[first:end, None], keys.shape[2], sliding_window)
                if batch is None else batch.visible(first, end, keys.shape[2], sliding_window))
        y = F.scaled_dot_product_attention(q[first:end, :, None], keys, values,
                                           attn_mask=mask[:, None, None], scale=scale,
                                           enable_gqa=q.shape[1] != keys.shape[1])
        parts.append(y[:, :, 0])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _cascade(q: torch.Tensor, pool: KVPool, layer: int, batch: StepBatch,
             scale: float | None) -> torch.Tensor:
    """``paged_attention`` for rows whose tables all begin with the same
    blocks, their new tokens after them (``batch.shared``; cascade attention): every
    token's query against those blocks, gathered once, in one SDPA (grouped by key/value
    head, so grouped heads read their keys once); each row against its own blocks after
    them (decode rows in row groups, each prompt chunk alone); the two softmaxes merged by
    their log-sum-exps. Each row gathered its own copy of the shared blocks before; on the
    CPU those copies were most of a step's time under a long shared prompt."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    (rows, shared), (_, heads, dim) = batch.shared, q.shape
    tokens = batch.row_starts[rows]
    kv_heads, size, decodes = pool.keys.shape[3], batch.block_size, min(batch.num_decodes, rows)
    group, offset = heads // kv_heads, shared * size
    by_kv_head = q[:tokens].view(tokens, kv_heads, group, dim)

    def grouped(part: torch.Tensor) -> torch.Tensor:  # [T, kvh, g, d] -> [1, kvh, g * T, d]
        return part.permute(1, 2, 0, 3).reshape(1, kv_heads, -1, dim)

    def ungrouped(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (out.view(kv_heads, group, -1, dim).permute(2, 0, 1, 3),
                lse.view(kv_heads, group, -1).permute(2, 0, 1))

    def own(first: int, end: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = gather(pool, layer, tables, q.dtype)
        seen = visible(batch.positions[first:end, None] - offset, keys.shape[2], None)
        mask = torch.zeros(seen.shape, dtype=q.dtype).masked_fill_(~seen, float("-inf"))
        if first >= decodes:  # a chunk: its tokens as one row's query positions
            return ungrouped(*flash(grouped(by_kv_head[first:end]), keys, values,
                                    attn_mask=mask.repeat(group, 1)[None, None], scale=scale))
        return flash(by_kv_head[first:end], keys, values, attn_mask=mask[:, None, None],
                     scale=scale)

    keys, values = gather(pool, layer, batch.block_tables[:1, :shared], q.dtype)
    shared_out, shared_lse = ungrouped(*flash(grouped(by_kv_head), keys, values, scale=scale))
    widths = [blocks_for(context, size) - shared for context in batch.host_context_lens]
    groups = row_groups(widths[:decodes], pool.keys[0, 0].numel() * q.element_size(),
                        q.device) if decodes else []
    parts = [own(first, end, batch.block_tables[first:end, shared:shared + width])
             for first, end, width in groups]
    parts += [own(batch.row_starts[row], batch.row_starts[row + 1],
                  batch.block_tables[row:row + 1, shared:shared + widths[row]])
              for row in range(decodes, rows)]
    own_out, own_lse = torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
    top = torch.maximum(shared_lse, own_lse)
    shared_weight, own_weight = (shared_lse - top).exp(), (own_lse - top).exp()
    merged = ((shared_out * shared_weight[..., None] + own_out * own_weight[..., None])
              / (shared_weight + own_weight)[..., None])
    return merged.reshape(tokens, heads, dim).to(q.dtype)


def paged_attention(q: torch.Tensor, pool: KVPool, layer: int, batch: StepBatch,
                    scale: float | None = None,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Attention of ``batch``'s new tokens, ``q[N, heads, head_dim]``, over their
    sequences' blocks (their own keys and values written first): decode rows in groups,
    each over the blocks the longest of its rows needs (``row_groups``), each prefill
    chunk in its own over its blocks up to its context, token at position ``p`` seeing
    positions ``<= p``. Returns ``[N, heads, value_dim]``.

    Chunks padded into one SDPA over the longest context took 1.5 to 3.8 times as long on
    the CPU (4 chunks of 256 tokens at 0 to 512: 27 ms against 13 per layer, 8 heads of
    32). A chunk from position 0 without a window goes as ``is_causal``, which skips the
    masked half (12.5 ms against 24 for 1,024 tokens)."""
    size, decodes = batch.block_size, batch.num_decodes
    gqa = q.shape[1] != pool.keys.shape[3]
    parts, done = [], 0  # rows attended so far
    if (batch.shared[0] and sliding_window is None and q.device.type == "cpu"
            and pool.keys.shape[-1] == pool.values.shape[-1]):
        parts.append(_cascade(q, pool, layer, batch, scale))
        done = batch.shared[0]
    if decodes and not done:
        widths = [blocks_for(context, size) for context in batch.host_context_lens[:decodes]]
        parts.append(_one_token_rows(q[:decodes], pool, layer, batch.positions[:decodes],
                                     batch.block_tables, widths, scale, sliding_window,
                                     batch))
    for row in range(max(decodes, done), batch.num_rows):
        first, end = batch.row_starts[row], batch.row_starts[row + 1]
        context = batch.host_context_lens[row]
        tables = batch.block_tables[row:row + 1, :blocks_for(context, size)]
        keys, values = gather(pool, layer, tables, q.dtype)
        causal = context == end - first and sliding_window is None  # a chunk from position 0
        mask = None if causal else \
            batch.visible(first, end, context, sliding_window)[None, None]
        y = F.scaled_dot_product_attention(q[first:end].transpose(0, 1)[None],
                                           keys[:, :, :context], values[:, :, :context],
                                           attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=gqa)
        parts.append(y[0].transpose(0, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
