"""Count the FLOPs of one training step from the model itself, once, with FlopCounterMode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import flop_counter

_aten = torch.ops.aten


def _cpu_sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args,
                       out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape,
                                                 value_shape)


# torch has no formula for the CPU flash-attention kernels; without these MFU is understated.
CUSTOM_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_forward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


def count_flops(step: Callable[[], None]) -> int:
    """Total FLOPs of everything ``step`` runs (forward and backward)."""
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=CUSTOM_FLOP_FORMULAS)
    with counter:
        step()
    return counter.get_total_flops()
