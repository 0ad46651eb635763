"""Steps that leave no trace: for counting a step's FLOPs, probing batch sizes and compiling
before training starts, without moving the run's RNG streams, buffers or gradients."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gpuflow.errors import UserError
from gpuflow.parallel.strategy import Loss
from gpuflow.precision import PrecisionPolicy
from gpuflow.telemetry.flops import count_flops, count_training_flops
from gpuflow.workload import call_model


@contextlib.contextmanager
def side_effect_free(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Run a probe step without disturbing RNG streams, buffers (e.g. BatchNorm) or grads."""
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, buf in model.named_buffers():
                    buf.copy_(buffers[name])
            for param in model.parameters():
                param.grad = None


def probe_step(model: nn.Module, forward: nn.Module, batch: tuple[Any, torch.Tensor],
               loss_fn: Loss, policy: PrecisionPolicy, device: torch.device) -> None:
    """Forward (through ``forward``, the model or a wrapped or compiled form of it) and
    backward of one batch, leaving no trace on ``model``."""
    inputs, target = batch
    with side_effect_free(model, device):
        with policy.autocast():
            loss = loss_fn(call_model(forward, inputs), target)
        loss.backward()


def step_flops(model: nn.Module, example: tuple[Any, torch.Tensor], loss_fn: Loss,
               policy: PrecisionPolicy, device: torch.device, workload: str) -> int:
    """FLOPs of one forward+backward on the example batch.

    Counted on fake tensors, which cost no memory or time on the device; a model that fake
    tensors cannot run is counted on a real (side-effect-free) step instead, with a warning.
    """
    inputs, target = example
    try:
        return count_training_flops(model, inputs, target, loss_fn, policy.autocast())
    except Exception as exc:  # fake tensors cannot run this model: count a real step
        reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
        warnings.warn(
            f"Workload {workload!r}: its FLOPs cannot be counted on fake tensors ({reason}); "
            f"they are counted on one real forward and backward of the example batch on "
            f"{device} instead, which costs that step's time and memory once at set-up.",
            stacklevel=2)
        return _real_step_flops(model, example, loss_fn, policy, device, workload)


def _real_step_flops(model: nn.Module, example: tuple[Any, torch.Tensor], loss_fn: Loss,
                     policy: PrecisionPolicy, device: torch.device, workload: str) -> int:
    try:
        return count_flops(lambda: probe_step(model, model, example, loss_fn, policy, device))
    except Exception as exc:
        raise UserError(
            f"Workload {workload!r}: the model failed on a batch from its train dataset "
            f"({type(exc).__name__}: {exc}). Check that the dataset yields (inputs, target) "
            "pairs whose shapes and dtypes the model and loss accept."
        ) from exc
