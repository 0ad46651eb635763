"""The paged KV seam between the generation engine and its models.

Keys and values live in one pool of fixed-size blocks allocated once; a sequence holds a
table of the blocks it has filled, in order, so it costs only the memory of its real
length. One engine step is a ``StepBatch``: the new tokens of several sequences laid flat
(decode rows of one token first, then prefill chunks), each token's position and the pool
slot its key and value go to, and each row's block table. A model (``PagedLM``) writes the
new keys and values, then attends through the block tables (``attention.py``): decode rows
together in one SDPA over their gathered blocks, each prefill chunk in its own, causal
from its offset.

``decode_step`` is the static-shape variant for compiled decoding and CUDA graphs: every
row attends over all the blocks its table can name under a mask, so shapes depend on the
batch size alone and nothing is read back to the host.

Block 0 is the null block: tables are padded with it, padding rows write into it, and no
sequence is ever given it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Literal, NamedTuple, Protocol

import torch

from gpuflow.serve.generate.blocks import NULL_BLOCK, blocks_for
from gpuflow.serve.generate.lora_slots import LoraPass, LoraSlots, lora_passes

# Rows of a step attend once to the blocks they share when that spares the other rows this
# many gathered positions or more (below it, the second SDPA and the merge cost more).
SHARED_MIN_SAVED = 768
Wanted = Literal["last", "all", "none"]  # the tokens of a row whose logits a forward returns


class RowSpec(NamedTuple):
    """One sequence in a step: its new tokens, the position of the first, its block table
    (covering at least ``start + len(tokens)`` positions), which logits it wants, and the
    slot of the LoRA adapter it runs under (``lora_slots.NO_ADAPTER``: the base alone)."""

    tokens: Sequence[int]
    start: int
    blocks: Sequence[int]
    logits: Wanted = "last"
    adapter: int = -1


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
    lora: tuple[LoraPass, ...] = ()  # the tokens under LoRA adapters, by pass (none: none)
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
        contexts: list[int] = []
        for row in rows:  # once a step per running sequence: kept lean
            new, start, blocks, wanted, _ = row
            count = len(new)
            end = start + count
            if count == 0 or start < 0:
                raise ValueError(f"a row needs new tokens at a position >= 0 (got {row})")
            if len(blocks) * block_size < end:
                raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold "
                                 f"{end} positions")
            if NULL_BLOCK in blocks[:blocks_for(end, block_size)]:
                raise ValueError("no sequence may hold the null block")
            first = row_starts[-1]
            tokens.extend(new)
            if count == 1:  # a decode row
                positions.append(start)
                slots.append(blocks[start // block_size] * block_size + start % block_size)
            else:
                span = range(start, end)
                positions.extend(span)
                slots.extend(blocks[p // block_size] * block_size + p % block_size
                             for p in span)
            row_starts.append(first + count)
            contexts.append(end)
            if wanted == "last":
                logits_at.append(first + count - 1)
            elif wanted == "all":
                logits_at.extend(range(first, first + count))
        widest = max(len(row.blocks) for row in rows)
        width = widest if max_blocks is None else max_blocks
        if widest > width:
            raise ValueError(f"a block table is wider than max_blocks ({width})")
        tables = [list(row.blocks) + [NULL_BLOCK] * (width - len(row.blocks)) for row in rows]
        decodes = next((i for i, row in enumerate(rows) if len(row.tokens) != 1), len(rows))
        # A step of the base alone (every step where no adapter is served) lays out nothing.
        passes = (lora_passes([(row.adapter, len(row.tokens)) for row in rows])
                  if any(row.adapter >= 0 for row in rows) else [])

        # One host tensor and one copy to the device (a copy from pageable memory waits for
        # the device), cut into the batch's tensors as views.
        parts = [tokens, positions, slots, contexts, list(chain.from_iterable(tables)), logits_at,
                 *(part for lora in passes for part in lora[:3])]
        flat = torch.tensor(list(chain.from_iterable(parts)), dtype=torch.long).to(device)
        token_ids, token_positions, slot_ids, context_lens, table_ids, at, *lora = flat.split(
            [len(part) for part in parts])
        return cls(token_ids, token_positions, slot_ids, tuple(row_starts), context_lens,
                   table_ids.view(len(rows), width), decodes, at, tuple(contexts), block_size,
                   cascade(rows, decodes, block_size),
                   tuple(LoraPass(*lora[3 * i:3 * i + 3], *layout[3:])
                         for i, layout in enumerate(passes)))


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


class PagedLM(Protocol):
    """A model the engine drives over a ``KVPool``: gpuflow's GPT (``GPTDecoder``), any
    Hugging Face causal LM (``HFCausalLM``) and the Llama family's own forward
    (``LlamaDecoder``)."""

    context: int
    vocab_size: int
    adapters: LoraSlots | None  # LoRA adapters' slots, for the models that take them

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

    def prepack(self) -> None:
        """Lay the weights out for the engine's eager steps where that pays, in the process
        that steps (a copy of its own; not for a compiled step, which traces the forward)."""
        ...
