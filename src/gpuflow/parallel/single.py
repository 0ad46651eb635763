"""The whole model in one process (``--strategy single``), and what the layouts that wrap a
whole model build on: DDP wraps it, TP and FSDP split its blocks in place."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpuflow.parallel.strategy import Loss, ModelParts, Strategy, apply_activation_checkpointing

if TYPE_CHECKING:
    from torch.amp import GradScaler

    from gpuflow.telemetry import waits as timed_waits


class Single(Strategy):
    """The step calls the model, wrapped by :meth:`wrap`, with nothing to synchronise; a
    layout that wraps the model overrides :meth:`wrap` and, where gradients are reduced,
    :meth:`no_backward_sync`."""

    def setup(self, model: nn.Module, parts: ModelParts, example: Any, batch_size: int
              ) -> None:
        self.call_model: Callable[[nn.Module, Any], Any] = parts.call_model
        self.saves_frozen = parts.saves_frozen
        self.model = model
        self.forward_model = self.wrap(model, parts)

    def wrap(self, model: nn.Module, parts: ModelParts) -> nn.Module:
        """The module the step calls; here only checkpointed activations change it."""
        if parts.activation_checkpointing:
            apply_activation_checkpointing(model, parts.blocks())
        return model

    def no_backward_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient synchronisation unless this is an optimizer step's last
        micro-batch; nothing to skip here."""
        return contextlib.nullcontext()

    def forward_backward(self, inputs: Any, target: torch.Tensor, loss_fn: Loss,
                         micro: int, accum: int, scaler: GradScaler | None) -> torch.Tensor:
        with self.no_backward_sync(micro == accum - 1), self._collective_waits:
            with self.policy.autocast():
                loss = loss_fn(self.call_model(self.forward_model, inputs), target)
            scaled = loss / accum if accum > 1 else loss
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        return loss.detach()

    def finish_backward(self) -> None:
        """Nothing: backward left every gradient where the optimizer reads it."""

    def eval_outputs(self, inputs: Any, target: torch.Tensor) -> Any:
        return self.call_model(self.model, inputs)

    def untimed_waits(self) -> list[timed_waits.Wait] | None:
        return []
