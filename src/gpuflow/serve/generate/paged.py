"""The paged KV seam between the generation engine and its models.

Keys and values live in one pool of fixed-size blocks allocated once; a sequence holds a
table of the blocks it has filled, in order, so it costs only the memory of its real
length. One engine step is a ``StepBatch``: the new tokens of several sequences laid flat
(decode rows of one token first, then prefill chunks), each token's position and the pool
slot its key and value go to, and each row's block table. A model (``PagedLM``) writes the
new keys and values, then attends through the block tables: decode rows together in one
SDPA over their gathered blocks, each prefill chunk in its own, causal from its offset.

``decode_step`` is the static-shape variant for compiled decoding and CUDA graphs: every
row attends over all the blocks its table can name under a mask, so shapes depend on the
batch size alone and nothing is read back to the host.

Block 0 is the null block: tables are padded with it, padding rows write into it, and no
sequence is ever given it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Literal, NamedTuple, Protocol

import torch
from torch.nn import functional as F

from gpuflow.serve.generate.blocks import NULL_BLOCK, blocks_for

GATHER_BYTES = 2 << 20  # the keys one decode SDPA gathers at most on the CPU (row_groups)
# Rows of a step attend once to the blocks they share when that spares the other rows this
# many gathered positions or more (below it, the second SDPA and the merge cost more).
SHARED_MIN_SAVED = 768
Wanted = Literal["last", "all", "none"]  # the tokens of a row whose logits a forward returns


class RowSpec(NamedTuple):
    """One sequence in a step: its new tokens, the position of the first, its block table
    (covering at least ``start + len(tokens)`` positions) and which logits it wants."""

    tokens: Sequence[int]
    start: int
    blocks: Sequence[int]
    logits: Wanted = "last"


@dataclass(frozen=True)
class StepBatch:
    """One forward of the engine over several sequences, their new tokens laid flat.

    ``host_context_lens`` repeats ``context_lens`` on the host, so that attention sizes its
    gathers without reading the device."""

    tokens: torch.Tensor  # [N] every row's new tokens; decode rows first, then prefill chunks
    positions: torch.Tensor  # [N] each token's position in its sequence
    slot_mapping: torch.Tensor  # [N] block * block_size + offset where its key/value go
    row_starts: tuple[int, ...]  # B + 1: row b is tokens[row_starts[b]:row_starts[b + 1]]
    context_lens: torch.Tensor  # [B] tokens row b sees after this step
    block_tables: torch.Tensor  # [B, max_blocks] row b's blocks, padded with NULL_BLOCK
    num_decodes: int  # rows 0..num_decodes-1 have one new token each
    logits_at: torch.Tensor  # [K] flat indices into tokens whose logits the forward returns
    host_context_lens: tuple[int, ...]
    block_size: int
    shared: tuple[int, int] = (0, 0)  # leading (rows, blocks) that share blocks (``cascade``)
    # Attention masks made for this step, by (first token, end, span, window): every
    # layer's attention asks for the same ones.
    masks: dict[tuple[int, int, int, int | None], torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False)

    def visible(self, first: int, end: int, span: int,
                sliding_window: int | None) -> torch.Tensor:
        """``visible`` for tokens ``first:end`` over ``span`` key positions, made once a
        step."""
        key = (first, end, span, sliding_window)
        mask = self.masks.get(key)
        if mask is None:
            mask = self.masks[key] = visible(self.positions[first:end, None], span,
                                             sliding_window)
        return mask

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1

    @classmethod
    def build(cls, rows: Sequence[RowSpec], block_size: int,
              device: torch.device | str = "cpu", max_blocks: int | None = None) -> StepBatch:
        """The batch of ``rows`` (decode rows first), every tensor made on the host in one
        go and sent to ``device``. ``max_blocks`` pads the tables to a fixed width."""
        if not rows:
            raise ValueError("a step needs at least one row")
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_starts = [0]
        logits_at: list[int] = []
        for row in rows:
            count, end = len(row.tokens), row.start + len(row.tokens)
            if count == 0 or row.start < 0:
                raise ValueError(f"a row needs new tokens at a position >= 0 (got {row})")
            if len(row.blocks) * block_size < end:
                raise ValueError(f"{len(row.blocks)} blocks of {block_size} cannot hold "
                                 f"{end} positions")
            if NULL_BLOCK in row.blocks[:blocks_for(end, block_size)]:
                raise ValueError("no sequence may hold the null block")
            first = row_starts[-1]
            tokens.extend(row.tokens)
            span = range(row.start, end)
            positions.extend(span)
            slots.extend(row.blocks[p // block_size] * block_size + p % block_size
                         for p in span)
            row_starts.append(first + count)
            if row.logits == "last":
                logits_at.append(first + count - 1)
            elif row.logits == "all":
                logits_at.extend(range(first, first + count))
        width = max(len(row.blocks) for row in rows) if max_blocks is None else max_blocks
        if any(len(row.blocks) > width for row in rows):
            raise ValueError(f"a block table is wider than max_blocks ({width})")
        tables = [list(row.blocks) + [NULL_BLOCK] * (width - len(row.blocks)) for row in rows]
        contexts = tuple(row.start + len(row.tokens) for row in rows)
        decodes = next((i for i, row in enumerate(rows) if len(row.tokens) != 1), len(rows))

        # One host tensor and one copy to the device (a copy from pageable memory waits for
        # the device), cut into the batch's tensors as views.
        parts = [tokens, positions, slots, contexts, list(chain.from_iterable(tables)), logits_at]
        flat = torch.tensor(list(chain.from_iterable(parts)), dtype=torch.long).to(device)
        token_ids, token_positions, slot_ids, context_lens, table_ids, at = flat.split(
            [len(part) for part in parts])
        return cls(token_ids, token_positions, slot_ids, tuple(row_starts), context_lens,
                   table_ids.view(len(rows), width), decodes, at, contexts, block_size,
                   cascade(rows, decodes, block_size))


def cascade(rows: Sequence[RowSpec], decodes: int, block_size: int) -> tuple[int, int]:
    """The leading rows that attend to their shared blocks once, and how many blocks: all
    rows, or the decode rows alone where a prompt chunk shares fewer of their blocks
    (decode rows continuing one prompt share more than a new prompt does), whichever
    spares more gathered positions; (0, 0) for none."""
    options = [(len(rows), shared_prefix([r.blocks for r in rows], [r.start for r in rows],
                                         block_size))]
    if 0 < decodes < len(rows):
        options.append((decodes, shared_prefix([r.blocks for r in rows[:decodes]],
                                               [r.start for r in rows[:decodes]], block_size)))
    best = max(options, key=lambda option: (option[0] - 1) * option[1])
    return best if best[1] else (0, 0)


def shared_prefix(tables: Sequence[Sequence[int]], starts: Sequence[int],
                  block_size: int) -> int:
    """How many leading blocks two or more rows all hold, every row's new tokens after them
    (a prompt prefix the prefix cache gave them all), when attending to them once spares
    the other rows ``SHARED_MIN_SAVED`` gathered positions or more; 0 otherwise."""
    if len(tables) < 2:
        return 0
    limit = min(starts) // block_size
    shared = 0
    while shared < limit and len({table[shared] for table in tables}) == 1:
        shared += 1
    return shared if (len(tables) - 1) * shared * block_size >= SHARED_MIN_SAVED else 0


def check_context(batch: StepBatch, context: int) -> None:
    """Refuse a step that runs a sequence past the model's context, before a position
    table is read out of its bounds (on the host: ``host_context_lens``)."""
    longest = max(batch.host_context_lens)
    if longest > context:
        raise ValueError(f"a sequence of {longest} tokens is longer than the model's context "
                         f"({context})")


class KVPool:
    """The paged KV cache: keys and values ``[layers, num_blocks, block_size, kv_heads,
    head_dim]`` each, allocated once. Block 0 is the null block: padding rows and padding
    tokens write there, and no sequence is ever given it.

    A block's tokens come before its heads (the layout of flash-attn's paged cache): a new
    token's key is one contiguous write, and the blocks of a table, gathered, are every
    position in order, ``[positions, heads, dim]``, which SDPA reads as ``[heads,
    positions, dim]`` through a transposed view, with no second copy."""

    def __init__(self, layers: int, num_blocks: int, kv_heads: int, block_size: int,
                 head_dim: int, device: torch.device | str, dtype: torch.dtype,
                 value_dim: int | None = None) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a pool needs 2 blocks or more (the null block and one) of 1 "
                             f"token or more (got {num_blocks} of {block_size})")
        dims = (layers, num_blocks, block_size, kv_heads)
        self.keys = torch.zeros((*dims, head_dim), device=device, dtype=dtype)
        self.values = torch.zeros((*dims, value_dim or head_dim), device=device, dtype=dtype)
        self.block_size, self.num_blocks = block_size, num_blocks

    def nbytes(self) -> int:
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()

    @staticmethod
    def bytes_per_block(layers: int, kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype, value_dim: int | None = None) -> int:
        return layers * kv_heads * block_size * (head_dim + (value_dim or head_dim)) \
            * dtype.itemsize


def slot_index(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's block and offset in it: computed once a step for an eager forward's
    ``write_kv`` calls, not once a layer."""
    return slot_mapping // block_size, slot_mapping % block_size


def write_kv(pool: KVPool, layer: int, keys: torch.Tensor, values: torch.Tensor,
             slot_mapping: torch.Tensor,
             at: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write ``keys[N, kv_heads, head_dim]`` (and values) at their pool slots, in place.
    Compiled (no ``at``), the whole pool tensor is indexed (layer, block and offset each a
    tensor index), not a view of one layer: inductor then writes in place, where a write
    through the view made it copy the pool. Eager, ``at`` (``slot_index``) indexes the
    layer's view."""
    if keys.dtype != pool.keys.dtype:
        keys, values = keys.to(pool.keys.dtype), values.to(pool.values.dtype)
    if at is not None:
        pool.keys[layer][at] = keys
        pool.values[layer][at] = values
        return
    index = (torch.full_like(slot_mapping, layer), slot_mapping // pool.block_size,
             slot_mapping % pool.block_size)
    pool.keys[index] = keys
    pool.values[index] = values


def gather(pool: KVPool, layer: int, tables: torch.Tensor, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of ``tables[B, M]``'s blocks in order, ``[B, kv_heads, M *
    block_size, dim]`` (a transposed view): index ``j`` of row ``b`` holds its position
    ``j``."""
    batch, width = tables.shape
    flat = tables.reshape(-1)

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        # index_select copies several times faster than advanced indexing.
        blocks = tensor[layer].index_select(0, flat)  # [B * M, block_size, kv_heads, dim]
        size, heads, dim = blocks.shape[1:]
        gathered = blocks.view(batch, width * size, heads, dim).transpose(1, 2)
        return gathered if gathered.dtype == dtype else gathered.to(dtype)

    return rows(pool.keys), rows(pool.values)


def visible(positions: torch.Tensor, span: int, sliding_window: int | None) -> torch.Tensor:
    """Whether a token at ``positions[..., 1]`` sees key positions ``0..span-1``: its own
    and earlier ones, the last ``sliding_window`` of them only where one is set."""
    keys = torch.arange(span, device=positions.device)
    seen = keys <= positions
    return seen if sliding_window is None else seen & (keys > positions - sliding_window)


def decode_attention(q: torch.Tensor, pool: KVPool, layer: int, positions: torch.Tensor,
                     block_tables: torch.Tensor, scale: float | None = None,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one token per row, ``q[B, heads, head_dim]`` at ``positions[B]``, over
    every position ``block_tables[B, M]`` names, under a mask: shapes depend on ``B`` and
    ``M`` alone and nothing is read back to the host (for ``torch.compile(dynamic=False)``
    and CUDA graphs). Returns ``[B, heads, value_dim]``."""
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


class PagedLM(Protocol):
    """A model the engine drives over a ``KVPool``: gpuflow's GPT (``GPTDecoder``), any
    Hugging Face causal LM (``HFCausalLM``) and the Llama family's own forward
    (``LlamaDecoder``)."""

    context: int
    vocab_size: int

    def new_pool(self, num_blocks: int, block_size: int) -> KVPool: ...

    def bytes_per_block(self, block_size: int) -> int: ...

    def forward(self, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        """Logits ``[K, vocab_size]`` at ``batch.logits_at``, every new token's key and
        value written first."""
        ...

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    pool: KVPool) -> torch.Tensor:
        """Logits ``[B, vocab_size]`` of one token per row, in static shapes."""
        ...

    def written(self, pool: KVPool) -> list[torch.Tensor]:
        """The tensors ``decode_step`` writes into (for ``mark_static_address``)."""
        ...
