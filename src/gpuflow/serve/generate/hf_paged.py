"""A ``transformers.Cache`` over the engine's ``KVPool``, for any Hugging Face causal LM.

transformers' forward takes a ``[B, T]`` batch, so a step's flat tokens go in right-padded,
one row per sequence. Each attention layer's ``cache.update(...)`` writes the real tokens'
keys and values at their pool slots (padding tokens write nothing) and returns each row's
blocks gathered in order, index ``j`` holding position ``j``; the caller's 4-D mask shows
each token the positions up to its own (``HFCausalLM._mask``). A cache is made for one
forward: the pool is what lasts.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from gpuflow.serve.generate.blocks import blocks_for
from gpuflow.serve.generate.paged import KVPool, StepBatch, gather, write_kv


@dataclass(frozen=True)
class PagedRows:
    """Where one forward writes and reads: each real token's pool slot, its index in the
    padded ``[B, T]`` batch flattened (None when every row is one real token), the rows'
    block tables ``[B, M]``, and which of the step's flat tokens are theirs."""

    slot_mapping: torch.Tensor
    padded_at: torch.Tensor | None
    tables: torch.Tensor
    length: int
    tokens: slice

    @classmethod
    def parts(cls, batch: StepBatch) -> list[PagedRows]:
        """The step as at most two forwards, decode rows and then prefill chunks: padded
        together, every decode row would carry as many padding tokens as the longest
        chunk has tokens."""
        bounds = (0, batch.num_decodes, batch.num_rows)
        return [cls.of(batch, first, end) for first, end in pairwise(bounds)
                if end > first]

    @classmethod
    def of(cls, batch: StepBatch, first: int, end: int) -> PagedRows:
        """Rows ``first..end-1`` of ``batch``, each padded to the longest of them, the
        tables cut to the blocks their longest context needs."""
        starts = batch.row_starts[first:end + 1]
        length = max(stop - start for start, stop in pairwise(starts))
        padded_at = None
        if length > 1:
            at = [row * length + t for row in range(end - first)
                  for t in range(starts[row + 1] - starts[row])]
            padded_at = torch.tensor(at, dtype=torch.long).to(batch.tokens.device)
        width = blocks_for(max(batch.host_context_lens[first:end]), batch.block_size)
        tokens = slice(starts[0], starts[-1])
        return cls(batch.slot_mapping[tokens], padded_at, batch.block_tables[first:end, :width],
                   length, tokens)

    @property
    def rows(self) -> int:
        return self.tables.shape[0]

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """These rows' tokens of the step's ``flat[N]`` as ``[B, T]``, padding with 0
        (token 0, position 0: a padding token sees its row's first position alone)."""
        flat = flat[self.tokens]
        if self.padded_at is None:
            return flat.view(self.rows, 1)
        out = flat.new_zeros(self.rows * self.length)
        return out.index_copy_(0, self.padded_at, flat).view(self.rows, self.length)

    def flat(self, states: torch.Tensor) -> torch.Tensor:
        """``states[B, heads, T, dim]`` of the real tokens only, ``[N, heads, dim]``."""
        tokens = states.transpose(1, 2).flatten(0, 1)
        return tokens if self.padded_at is None else tokens.index_select(0, self.padded_at)


class PagedLayer(CacheLayerMixin):
    """One attention layer of the pool, written at the step's slots and read through its
    block tables."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: PagedCache, layer: int) -> None:
        super().__init__()
        self.owner, self.layer = owner, layer
        self.device = owner.pool.keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the pool is allocated once, up front

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the real tokens of ``key_states[B, heads, T, dim]`` (and values); return
        every row's gathered blocks, ``[B, heads, M * block_size, dim]``."""
        pool, rows = self.owner.pool, self.owner.rows
        write_kv(pool, self.layer, rows.flat(key_states), rows.flat(value_states),
                 rows.slot_mapping)
        return gather(pool, self.layer, rows.tables, key_states.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.span, 0

    def get_seq_length(self) -> int:
        return self.owner.span - self.owner.rows.length

    def get_max_length(self) -> int:
        return self.owner.span


class PagedCache(Cache):
    """The pool as transformers' cache for one forward over ``rows``."""

    def __init__(self, pool: KVPool, rows: PagedRows) -> None:
        self.pool, self.rows = pool, rows
        self.span = rows.tables.shape[1] * pool.block_size
        super().__init__(layers=[PagedLayer(self, layer)
                                 for layer in range(pool.keys.shape[0])])
