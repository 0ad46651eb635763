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

- an eager step (``SegmentedStep``) lays its adapted tokens out by slot (``LoraPass``: each
  slot's tokens, padded to the longest; decode tokens and prompt chunks in passes of their
  own), runs batched products over the slots the pass uses, and adds each token's row into
  the output: the arithmetic of each token's own adapter, no loop over adapters;
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
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from gpuflow.serve.generate.adapter_files import (
    AdapterRef,
    AdapterWeights,
    BaseLayout,
    read_weights,
)


class LoraPass(NamedTuple):
    """One batched product of a step's tokens under LoRA adapters, over slots ``first`` to
    ``first + span - 1``: ``gather`` lays the pass's tokens out by slot, ``length`` positions
    a slot (its tokens' indices, then padding that repeats token 0); ``back`` is each of the
    step's tokens' position in that layout (any, for a token outside the pass), ``kept`` 1
    for the pass's tokens and 0 for the others (the base's, or the other pass's); ``whole``:
    the pass holds every token of the step."""

    gather: torch.Tensor
    back: torch.Tensor
    kept: torch.Tensor
    first: int
    span: int
    length: int
    whole: bool


Layout = tuple[list[int], list[int], list[int], int, int, int, bool]


def lora_passes(rows: Sequence[tuple[int, int]]) -> list[Layout]:
    """``LoraPass``es for rows of ``(slot, tokens)`` laid flat: the one-token rows (decodes)
    in one, the longer rows (prompt chunks, verified drafts) in another, so that a prompt
    chunk does not pad every slot's decode tokens to its length; none for rows of the base
    alone."""
    total = sum(count for _, count in rows)
    starts = [0]
    for _, count in rows:
        starts.append(starts[-1] + count)
    passes = []
    for single in (True, False):
        members = [(slot, range(start, start + count))
                   for (slot, count), start in zip(rows, starts, strict=False)
                   if slot >= 0 and (count == 1) == single]
        if members:
            passes.append(_layout(members, total))
    return passes


def _layout(members: list[tuple[int, range]], total: int) -> Layout:
    """One pass over ``members``, ``(slot, token indices)``, of a step of ``total`` tokens."""
    first = min(slot for slot, _ in members)
    span = max(slot for slot, _ in members) - first + 1
    by_slot: list[list[int]] = [[] for _ in range(span)]
    for slot, tokens in members:
        by_slot[slot - first].extend(tokens)
    length = max(len(tokens) for tokens in by_slot)
    gather: list[int] = []
    back, kept = [0] * total, [0] * total
    for index, tokens in enumerate(by_slot):
        gather += tokens + [0] * (length - len(tokens))
        for offset, token in enumerate(tokens):
            back[token], kept[token] = index * length + offset, 1
    return gather, back, kept, first, span, length, sum(kept) == total


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

    def segmented(self, passes: tuple[LoraPass, ...]) -> SegmentedStep:
        return SegmentedStep(self, passes)

    def masked(self, row_slots: torch.Tensor) -> MaskedStep:
        """Each row's slot in ``row_slots[B]`` (``NO_ADAPTER``: none)."""
        mask = (self._slot_ids[:, None] == row_slots[None, :])[..., None]
        return MaskedStep(self, mask.to(self.weights[0][0][0].dtype))


class LoraStep(Protocol):
    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: int
            ) -> torch.Tensor:
        """``out`` (the group's base product of ``x``, a tensor of its own, which an eager
        step adds into in place) plus each token's adapter."""
        ...


class SegmentedStep:
    """An eager step's adapters: its adapted tokens by slot, in passes (``LoraPass``)."""

    def __init__(self, slots: LoraSlots, passes: tuple[LoraPass, ...]) -> None:
        self.slots, self.passes = slots, passes
        # The tokens outside a pass take nothing from it: their rows are zeroed.
        dtype = slots.weights[0][0][0].dtype
        self.kept = [None if p.whole else p.kept.to(dtype)[:, None] for p in passes]

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: int
            ) -> torch.Tensor:
        rank = self.slots.rank
        a, bs = self.slots.weights[layer][group]
        for p, kept in zip(self.passes, self.kept, strict=True):
            slots = slice(p.first, p.first + p.span)
            laid = x.index_select(0, p.gather).view(p.span, p.length, -1)
            low = torch.bmm(laid, a[slots])  # [span, length, k * R]
            first = 0
            for j, b in enumerate(bs):  # each projection's rows into its own columns
                width = b.shape[-1]
                delta = torch.bmm(low[..., j * rank:(j + 1) * rank], b[slots])
                delta = delta.view(-1, width).index_select(0, p.back)  # the step's order
                if kept is not None:
                    delta.mul_(kept)
                columns = out if len(bs) == 1 else out[:, first:first + width]
                columns.add_(delta.to(out.dtype))
                first += width
        return out


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
