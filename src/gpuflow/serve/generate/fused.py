"""Linear layers that read the same input, multiplied as one: a decoder layer's query, key
and value projections, and its MLP's gate and up projections.

One matrix product instead of three (or two) is fewer kernel launches a step on a GPU and
fewer dispatched operators on any device, and a fused query/key output rotates as one
tensor. The modules' weights become views of the fused weight, so the model holds one
copy and every other path through it (``/v1/predict``, transformers' own forward) reads the
same memory; weights already laid out that way (a model the server fused, shared with the
engine's process) are viewed, not copied again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def fuse(modules: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The modules' weights as one ``[sum of out_features, in_features]`` weight and their
    biases as one (None without biases), the modules' own made views of them; None where
    the modules cannot be fused (a quantized weight subclass, biases on some only, other
    dtypes or devices)."""
    weights = [module.weight for module in modules]
    biases = [module.bias for module in modules]
    if (any(is_traceable_wrapper_subclass(w) or w.dim() != 2 for w in weights)
            or len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1
            or len({b is None for b in biases}) != 1):
        return None
    weight = _joined(modules, "weight")
    bias = None if biases[0] is None else _joined(modules, "bias")
    return weight, bias


def _joined(modules: Sequence[nn.Linear], name: str) -> torch.Tensor:
    """One tensor of the modules' ``name`` parameters along dim 0: a view where they already
    lie one after another in one storage, else a new tensor the parameters become views
    of."""
    parts: list[torch.Tensor] = [getattr(module, name) for module in modules]
    rows = sum(part.shape[0] for part in parts)
    shape = (rows, *parts[0].shape[1:])
    if _consecutive(parts):
        first = parts[0]
        return first.detach().as_strided(shape, torch.empty(shape, device="meta").stride(),
                                          first.storage_offset())
    with torch.no_grad():
        joined = torch.cat([part.detach() for part in parts])
    start = 0
    for module, part in zip(modules, parts, strict=True):
        count = part.shape[0]
        setattr(module, name, nn.Parameter(joined[start:start + count],
                                           requires_grad=part.requires_grad))
        start += count
    return joined


def _consecutive(parts: Sequence[torch.Tensor]) -> bool:
    """Whether ``parts`` are contiguous and follow one another in one storage."""
    if not all(part.is_contiguous() for part in parts):
        return False
    storage = parts[0].untyped_storage().data_ptr()
    for before, after in zip(parts, parts[1:], strict=False):
        if (after.untyped_storage().data_ptr() != storage
                or before.storage_offset() + before.numel() != after.storage_offset()):
            return False
    return True
