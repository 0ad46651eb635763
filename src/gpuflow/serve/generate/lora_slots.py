"""Many LoRA adapters in one engine step: the adapters the engine holds sit in slots of
stacked matrices on the device, and each token of a step adds its own slot's product.

For each group of projections the forward multiplies at once (a layer's queries, keys and
values; its output; its gate and up; its down), slot ``s`` owns ``k * R`` columns of ``A``
``[in, slots * k * R]`` and as many rows of ``B`` ``[slots * k * R, out]`` (``k``
projections in the group, ``R`` the largest rank served; a smaller adapter's other columns
are zero): its projections' ``lora_A`` transposed side by side, their scaled ``lora_B``
transposed, each into its own projection's output columns. A step adds every token's
adapter with three operators a group, whatever the mix: ``x @ A``, a mask keeping each
token's own slot's columns (none for the base's tokens), and a product into the output.
No loop over adapters and no weights gathered per token (the batching of S-LoRA and
Punica, as dense products): a step's products stop at the highest slot it uses, and a step
with no adapter's token adds nothing.

``SlotTable`` is the core's account of the slots: which adapter each holds, how many live
requests use it, and which idle ones go first when a new adapter needs a slot (least
recently used).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

import torch

from gpuflow.serve.generate.adapter_files import AdapterRef, AdapterWeights, BaseLayout, read_weights

GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
          ("down_proj",))
NO_ADAPTER = -1  # a row of the base model


class LoraSlots:
    """``slots`` adapters of rank up to ``rank`` for every decoder layer of a base of
    ``layout``, on ``device`` in ``dtype``, all slots zero to begin with."""

    def __init__(self, layout: BaseLayout, slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layout, self.slots, self.rank = layout, slots, rank
        self.weights: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(layout.layers):
            layer = []
            for group in GROUPS:
                fan_in = layout.shapes[group[0]][0]
                fan_out = sum(layout.shapes[module][1] for module in group)
                width = slots * len(group) * rank
                layer.append((torch.zeros(fan_in, width, dtype=dtype, device=device),
                              torch.zeros(width, fan_out, dtype=dtype, device=device)))
            self.weights.append(layer)
        self._columns = {k: torch.arange(slots, device=device).repeat_interleave(k * rank)
                         for k in {len(group) for group in GROUPS}}

    def tensors(self) -> list[torch.Tensor]:
        """Every slot matrix (a compiled step reads them at fixed addresses)."""
        return [t for layer in self.weights for pair in layer for t in pair]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def load(self, slot: int, adapter: AdapterWeights) -> None:
        """Write ``adapter`` into ``slot``, every column of the slot it does not fill zero."""
        for index, layer in enumerate(self.weights):
            for group, (a, b) in zip(GROUPS, layer, strict=True):
                width = len(group) * self.rank
                cols = slice(slot * width, (slot + 1) * width)
                a[:, cols] = 0
                b[cols] = 0
                out = 0
                for position, module in enumerate(group):
                    fan_out = self.layout.shapes[module][1]
                    pair = adapter.products.get((index, module))
                    if pair is not None:
                        down, up = pair
                        first = slot * width + position * self.rank
                        rank = down.shape[0]
                        a[:, first:first + rank] = down.t()
                        b[first:first + rank, out:out + fan_out] = up.t()
                    out += fan_out

    def step(self, token_slots: torch.Tensor, span: int | None = None) -> LoraStep:
        """A step's adapters: ``token_slots[N]`` each token's slot (``NO_ADAPTER``: none),
        the products over the first ``span`` slots (default: all)."""
        span = self.slots if span is None else span
        masks = {k: (token_slots[:, None] == columns[None, :span * k * self.rank])
                 .to(self.weights[0][0][0].dtype) for k, columns in self._columns.items()}
        return LoraStep(self, masks, span)


@dataclass(frozen=True)
class LoraStep:
    """One step's adapters: each group size's token mask ``[N, span * k * R]``."""

    slots: LoraSlots
    masks: dict[int, torch.Tensor]
    span: int

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: int) -> torch.Tensor:
        """``out`` (the group's base product of ``x``) plus each token's adapter."""
        a, b = self.slots.weights[layer][group]
        mask = self.masks[len(GROUPS[group])]
        width = mask.shape[1]
        low = torch.mm(x, a[:, :width]).mul_(mask)
        return torch.addmm(out, low, b[:width])


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
