"""Count the FLOPs of one training step from the model itself, once, with FlopCounterMode."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils import flop_counter
from torch.utils._pytree import tree_map_only

_aten = torch.ops.aten


def _cpu_sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward_by_convention(grad_out_shape, query_shape, key_shape, value_shape, *args,
                                 out_shape=None, **kwargs) -> int:
    """Twice the forward: the gradients of its two matmuls. torch's own formula also counts
    the score matrix that fused kernels recompute in backward; the field's convention
    (PaLM, torchtitan, llm.c: 6N + 12·L·d·T per token) counts work the model needs, not
    work a kernel chooses to redo."""
    return 2 * flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


# MFU by the convention: every attention backward is counted as twice its forward; and
# torch has no formula for the CPU flash-attention kernels, without which MFU is understated.
# Causal attention is counted in full, as the convention does.
CUSTOM_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_forward,
    **{op: _sdpa_backward_by_convention for op in (
        _aten._scaled_dot_product_flash_attention_for_cpu_backward,
        _aten._scaled_dot_product_flash_attention_backward,
        _aten._scaled_dot_product_efficient_attention_backward,
        _aten._scaled_dot_product_cudnn_attention_backward)},
}


def count_flops(step: Callable[[], None]) -> int:
    """Total FLOPs of everything ``step`` runs (forward and backward)."""
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=CUSTOM_FLOP_FORMULAS)
    with counter:
        step()
    return counter.get_total_flops()


def call_with_state(model: nn.Module, state: dict[str, torch.Tensor], inputs: Any) -> Any:
    """``model`` called on ``inputs`` (a tensor, a tuple of positional arguments or a dict
    of keyword arguments) with ``state`` standing in for its parameters and buffers."""
    if isinstance(inputs, dict):
        return functional_call(model, state, (), inputs)
    args = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    return functional_call(model, state, args)


def count_training_flops(model: nn.Module, inputs: Any, target: torch.Tensor,
                         loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                         autocast: contextlib.AbstractContextManager[Any]) -> int:
    """FLOPs of one forward and backward of ``model``, followed on fake tensors.

    Only shapes flow: nothing is allocated on the device or computed, and the model's own
    parameters, buffers and gradients are untouched. Raises whatever the model raises on
    fake tensors (data-dependent code), so the caller can count on real ones instead.
    """
    mode = FakeTensorMode()
    state: dict[str, torch.Tensor] = {
        name: mode.from_tensor(param.detach()).requires_grad_(param.requires_grad)
        for name, param in model.named_parameters()}
    state.update({name: mode.from_tensor(buffer) for name, buffer in model.named_buffers()})
    fake_inputs, fake_target = tree_map_only(torch.Tensor, mode.from_tensor, (inputs, target))

    def step() -> None:
        with autocast:
            loss = loss_fn(call_with_state(model, state, fake_inputs), fake_target)
        loss.backward()

    # A model that fails here is counted for real; torch's own log of the failure, with its
    # traceback, would only alarm the user.
    fake_log = logging.getLogger(FakeTensorMode.__module__)
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with mode:
            return count_flops(step)
    finally:
        fake_log.setLevel(level)
