"""Many LoRA adapters in one engine step: the adapters the engine holds sit in slots of
stacked matrices on the device, and each token of a step adds its own slot's product.

For each group of projections the forward multiplies at once (a layer's queries, keys and
values; its output; its gate and up; its down), ``A`` is ``[slots, in, k * R]`` (``k``
projections in the group, ``R`` the largest rank served; a smaller adapter's other columns
are zero), slot ``s`` holding its projections' ``lora_A`` transposed side by side, and each
projection has its own ``B`` ``[slots, R, out]``, the slot's scaled ``lora_B`` transposed (no
zero blocks to read: a step's products read every slot it reaches). A step adds every
token's adapter in a few operators a group, whatever the mix of adapters (the batching of
S-LoRA and Punica, in torch's own products):

- an eager step (``SegmentedStep``) lays its adapted tokens out by slot (``paged.LoraRows``:
  each slot's tokens, padded to the longest), and runs two batched products over the slots
  up to the highest it uses, then adds each token's row into the output: the arithmetic of
  each token's own adapter, no loop over adapters;
- a static-shape decode step (``MaskedStep``: compiled, CUDA graphs) multiplies every row by
  every slot and keeps each row's own by a mask: shapes that never change, and on a GPU the
  same weights read as a per-row gather would read once every slot is in use.

A step with no adapter's token adds nothing. ``SlotTable`` is the core's account of the
slots: which adapter each holds, how many live requests use it, and which idle one goes
first when a new adapter needs a slot (least recently used).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from gpuflow.serve.generate.adapter_files import (
    AdapterRef,
    AdapterWeights,
    BaseLayout,
    read_weights,
)


class LoraRows(NamedTuple):
    """A step's tokens under LoRA adapters, laid out by slot for batched products: slots
    ``0..span-1`` own ``length`` positions each of ``gather`` (the indices of the slot's
    tokens, then padding that repeats token 0); ``adapted``: the tokens under an adapter,
    ``picked``: their positions in that layout."""

    gather: torch.Tensor
    adapted: torch.Tensor
    picked: torch.Tensor
    span: int
    length: int


def lora_layout(rows: Sequence[tuple[int, int]]
                ) -> tuple[list[int], list[int], list[int], int, int]:
    """``LoraRows``' lists, span and length for rows of ``(slot, tokens)`` laid flat
    (empty lists and 0: no row under an adapter)."""
    span = max(slot for slot, _ in rows) + 1
    if span <= 0:
        return [], [], [], 0, 0
    by_slot: list[list[int]] = [[] for _ in range(span)]
    first = 0
    for slot, count in rows:
        if slot >= 0:
            by_slot[slot].extend(range(first, first + count))
        first += count
    length = max(len(tokens) for tokens in by_slot)
    gather: list[int] = []
    picked: list[int] = []
    for slot, tokens in enumerate(by_slot):
        gather += tokens + [0] * (length - len(tokens))
        picked += range(slot * length, slot * length + len(tokens))
    return gather, list(chain.from_iterable(by_slot)), picked, span, length


GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
          ("down_proj",))
NO_ADAPTER = -1  # a row of the base model


class LoraSlots:
    """``slots`` adapters of rank up to ``rank`` for every decoder layer of a base of
    ``layout``, on ``device`` in ``dtype``, all slots zero to begin with."""

    def __init__(self, layout: BaseLayout, slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layout, self.slots, self.rank = layout, slots, rank
        # Per layer and group: A [slots, in, k * R], and one B [slots, R, out] a projection.
        self.weights: list[list[tuple[torch.Tensor, list[torch.Tensor]]]] = []
        for _ in range(layout.layers):
            layer = []
            for group in GROUPS:
                fan_in = layout.shapes[group[0]][0]
                layer.append((torch.zeros(slots, fan_in, len(group) * rank, dtype=dtype,
                                          device=device),
                              [torch.zeros(slots, rank, layout.shapes[module][1], dtype=dtype,
                                           device=device) for module in group]))
            self.weights.append(layer)
        self._slot_ids = torch.arange(slots, device=device)

    def tensors(self) -> list[torch.Tensor]:
        """Every slot matrix (a compiled step reads them at fixed addresses)."""
        return [t for layer in self.weights for a, bs in layer for t in (a, *bs)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def load(self, slot: int, adapter: AdapterWeights) -> None:
        """Write ``adapter`` into ``slot``, every column of the slot it does not fill zero."""
        for index, layer in enumerate(self.weights):
            for group, (a, bs) in zip(GROUPS, layer, strict=True):
                a[slot] = 0
                for position, (module, b) in enumerate(zip(group, bs, strict=True)):
                    b[slot] = 0
                    pair = adapter.products.get((index, module))
                    if pair is not None:
                        down, up = pair
                        first, rank = position * self.rank, down.shape[0]
                        a[slot, :, first:first + rank] = down.t()
                        b[slot, :rank] = up.t()

    def segmented(self, rows: LoraRows) -> SegmentedStep:
        return SegmentedStep(self, rows)

    def masked(self, row_slots: torch.Tensor) -> MaskedStep:
        """Each row's slot in ``row_slots[B]`` (``NO_ADAPTER``: none)."""
        mask = (self._slot_ids[:, None] == row_slots[None, :])[..., None]
        return MaskedStep(self, mask.to(self.weights[0][0][0].dtype))


class LoraStep(Protocol):
    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: int
            ) -> torch.Tensor:
        """``out`` (the group's base product of ``x``) plus each token's adapter."""
        ...


class SegmentedStep:
    """An eager step's adapters: its adapted tokens by slot (``LoraRows``)."""

    def __init__(self, slots: LoraSlots, rows: LoraRows) -> None:
        self.slots, self.rows = slots, rows

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: int
            ) -> torch.Tensor:
        rows, rank = self.rows, self.slots.rank
        a, bs = self.slots.weights[layer][group]
        laid = x.index_select(0, rows.gather).view(rows.span, rows.length, -1)
        low = torch.bmm(laid, a[:rows.span])  # [span, length, k * R]
        deltas = [torch.bmm(low[..., j * rank:(j + 1) * rank], b[:rows.span])
                  for j, b in enumerate(bs)]
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
        delta = delta.view(-1, out.shape[1]).index_select(0, rows.picked)
        return out.index_add(0, rows.adapted, delta.to(out.dtype))


class MaskedStep:
    """A static-shape step's adapters: every row by every slot, ``mask[slots, B, 1]``
    keeping each row's own."""

    def __init__(self, slots: LoraSlots, mask: torch.Tensor) -> None:
        self.slots, self.mask = slots, mask

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: int
            ) -> torch.Tensor:
        rank = self.slots.rank
        a, bs = self.slots.weights[layer][group]
        low = torch.matmul(x, a) * self.mask  # [slots, B, k * R]
        deltas = [torch.matmul(low[..., j * rank:(j + 1) * rank], b).sum(0)
                  for j, b in enumerate(bs)]
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
        return out + delta.to(out.dtype)


class SlotTable:
    """The core's account of the slots: adapters registered (by id), the slot each loaded
    one holds, the live requests pinning it; a new adapter takes the lowest empty slot,
    else evicts the least recently used one nobody pins."""

    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots
        self.refs: dict[int, AdapterRef] = {}
        self._held: list[int | None] = [None] * slots.slots
        self._pins = [0] * slots.slots
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.loads = 0  # adapters read into a slot so far

    def register(self, ref: AdapterRef) -> None:
        self.refs[ref.id] = ref

    def forget(self, adapter: int) -> None:
        """Unregister an adapter; its slot empties once no request pins it."""
        self.refs.pop(adapter, None)
        for slot, held in enumerate(self._held):
            if held == adapter and not self._pins[slot]:
                self._empty(slot)

    def acquire(self, adapter: int) -> int | None:
        """The slot holding ``adapter``, pinned (read into one first if it holds none);
        None while every slot is pinned. ``KeyError`` for an adapter not registered."""
        ref = self.refs[adapter]
        if adapter in self._held:
            slot = self._held.index(adapter)
        else:
            empty = [s for s, held in enumerate(self._held) if held is None]
            if not empty and not self._idle:
                return None
            slot = empty[0] if empty else next(iter(self._idle))
            self._empty(slot)
            layout, (a, _) = self.slots.layout, self.slots.weights[0][0]
            self.slots.load(slot, read_weights(Path(ref.path), layout, a.dtype, a.device))
            self._held[slot] = adapter
            self.loads += 1
        self._pins[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        """A request using ``slot`` ended: with no other, the slot idles (or empties, its
        adapter unregistered)."""
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            if self._held[slot] in self.refs:
                self._idle[slot] = None
            else:
                self._empty(slot)

    def _empty(self, slot: int) -> None:
        self._held[slot] = None
        self._idle.pop(slot, None)
