"""Linear layers that read the same input, multiplied as one, with their weights laid out
for the device's matrix products: a decoder layer's query, key and value projections, and
its MLP's gate and up projections (each other linear is a fusion of one).

One matrix product instead of three (or two) is fewer kernel launches a step on a GPU and
fewer dispatched operators on any device, and a fused query/key output rotates as one
tensor. The modules' weights become views of the fused weight, so the model holds one
copy and every other path through it (``/v1/predict``, transformers' own forward) reads the
same memory; weights already laid out that way (a model the server fused, shared with the
engine's process) are viewed, not copied again.

An fp32 weight on the CPU is stored input-major (``[in_features, out_features]``
contiguous, the modules' ``[out, in]`` weights transposed views of it): the products of a
decode step multiply a few rows by a weight, and MKL's fp32 kernel for ``x @ W`` with ``W``
row-major runs up to 2.4x faster at 4-32 rows than ``x @ W.T`` over the usual layout
(``benchmarks/linear_layout.py``). bf16 products on the CPU (oneDNN, AMX where there is
one) gain at most 1.09x from it and lose at one row (0.85x), and a GPU's BLAS takes either
layout: those keep the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# Weights smaller than this multiply through MKL, never oneDNN's prepacked path (``prepacked``).
PREPACK_BYTES = 2**20


def input_major_for(weight: torch.Tensor) -> bool:
    """Whether linear weights like ``weight`` are laid out input-major (see the
    docstring): fp32 on the CPU."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def fuse(modules: Sequence[nn.Linear], input_major: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The modules' weights as one ``[sum of out_features, in_features]`` weight (its
    storage input-major if ``input_major``) and their biases as one (None without biases),
    the modules' own made views of them; None where the modules cannot be fused (a
    quantized weight subclass, biases on some only, other dtypes or devices)."""
    weights = [module.weight for module in modules]
    biases = [module.bias for module in modules]
    if (any(is_traceable_wrapper_subclass(w) or w.dim() != 2 for w in weights)
            or len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1
            or len({b is None for b in biases}) != 1):
        return None
    weight = _joined(modules, "weight", input_major)
    bias = None if biases[0] is None else _joined(modules, "bias", False)
    return weight, bias


def _joined(modules: Sequence[nn.Linear], name: str, input_major: bool) -> torch.Tensor:
    """One tensor of the modules' ``name`` parameters along dim 0: a view where they already
    lie one after another in one storage in the layout asked for, else a new tensor the
    parameters become views of."""
    parts: list[torch.Tensor] = [getattr(module, name) for module in modules]
    rows = sum(part.shape[0] for part in parts)
    shape = (rows, *parts[0].shape[1:])
    stride = (1, rows) if input_major else torch.empty(shape, device="meta").stride()
    if _laid_out(parts, stride):
        first = parts[0]
        return first.detach().as_strided(shape, stride, first.storage_offset())
    with torch.no_grad():
        joined = torch.cat([part.detach() for part in parts])
        if input_major:
            joined = joined.t().contiguous().t()
    start = 0
    for module, part in zip(modules, parts, strict=True):
        count = part.shape[0]
        setattr(module, name, nn.Parameter(joined[start:start + count],
                                           requires_grad=part.requires_grad))
        start += count
    return joined


def _laid_out(parts: Sequence[torch.Tensor], stride: tuple[int, ...]) -> bool:
    """Whether ``parts`` follow one another along dim 0 in one storage, as slices of one
    tensor with ``stride``."""
    step = stride[0]
    storage = parts[0].untyped_storage().data_ptr()
    for before, after in zip(parts, parts[1:], strict=False):
        if (after.untyped_storage().data_ptr() != storage
                or before.storage_offset() + before.shape[0] * step != after.storage_offset()):
            return False
    return all(part.stride() == stride for part in parts)


def prepacked(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (``[out, in]``) reordered into oneDNN's blocked layout for
    ``torch.ops.mkldnn._linear_pointwise``, where that pays: fp32 on the CPU (x86's
    oneDNN), a weight of ``PREPACK_BYTES`` or more. A decode step of 4-16 rows multiplies
    such weights 1.3-1.4x faster than MKL's input-major product, a model's weights read from
    memory as a served model's are; one row 0.78x, so one-row steps keep MKL's
    (``benchmarks/linear_layout.py``). A smaller weight is read from cache in less time than
    oneDNN's call costs over MKL's. The packed copy is the engine's own: the model's weights
    stay as they are for every other path."""
    if (not input_major_for(weight) or weight.numel() * weight.element_size() < PREPACK_BYTES
            or not torch.backends.mkldnn.is_available()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
