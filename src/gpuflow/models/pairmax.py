"""Max over adjacent pairs along one axis: ``F.max_pool2d(x, (2, 1))`` on the mel axis,
exactly, at a fraction of its cost on the CPU.

PyTorch's CPU max-pool over a (2, 1) window of an NCHW tensor takes ~20x as long as an
element-wise maximum of the two strided halves (8 x 32 x 80 x 400 fp32, one thread: 56 ms
against 2.8 ms), and in the speech front ends it was an eighth of a serving forward. The
gradient is max-pool's own, not ``torch.maximum``'s: all of it to the first of the pair when
the two are equal (``maximum`` splits a tie in halves), so training is unchanged bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch


class _PairMax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # Where max-pool takes the first: not smaller, or NaN (which it propagates).
            ctx.save_for_backward((first >= second) | first.isnan())
        return torch.maximum(first, second)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (takes_first,) = ctx.saved_tensors
        zero = grad.new_zeros(())
        return torch.where(takes_first, grad, zero), torch.where(takes_first, zero, grad)


def pair_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The larger of each adjacent pair along ``dim`` (of even size), as ``max_pool`` with a
    window and stride of 2 along it gives, gradient included."""
    if x.shape[dim] % 2:
        raise ValueError(f"pair_max needs an even size along dim {dim}, got {x.shape[dim]}")
    first, second = x.unflatten(dim, (x.shape[dim] // 2, 2)).unbind(dim + 1 if dim >= 0
                                                                     else dim)
    return _PairMax.apply(first, second)
