"""``--loss-chunks N``: a language model's loss without its full fp32 logits.

The LM head's forward is switched to hand back its input and weights (:class:`HeadInput`)
rather than the logits; the loss then runs the head and the cross-entropy over N chunks of
the rows, computing each chunk's gradients at once, so that one chunk's logits exist at a
time and nothing is recomputed (the logits of a 1B model at 16 x 2048 tokens and a 128k
vocabulary are about 16 GiB in fp32; the matrix products, and so the FLOPs, are those of the
unchunked step). Metrics get the whole logits. The loss is the default one (mean
cross-entropy over the targets not equal to ``IGNORE_INDEX``), equal to it within fp32
rounding. The trainer switches the head back when it closes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpuflow.errors import UserError
from gpuflow.workload import IGNORE_INDEX, Workload, cross_entropy, model_logits

if TYPE_CHECKING:
    from gpuflow.config import TrainConfig
    from gpuflow.parallel.dims import ParallelDims

# Strategies whose head weights stay whole after the forward: FSDP reshards them, tensor and
# pipeline parallelism split them.
CHUNKABLE_STRATEGIES = ("single", "ddp")


@dataclass
class HeadInput:
    """What the switched head returns: its input and its weights, read at the call (so a
    FLOP count on fake weights sees the fake ones)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None

    def logits(self) -> torch.Tensor:
        return nn.functional.linear(self.hidden, self.weight, self.bias)


def lm_head(model: nn.Module) -> nn.Linear | None:
    """The model's output projection: a Hugging Face model's output embeddings, or a
    ``lm_head`` linear layer (textlm's GPT)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Linear) else None


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Loss and gradients chunk by chunk in the forward; the backward only scales them."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, target: torch.Tensor, chunks: int) -> torch.Tensor:
        rows, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        count = (target != IGNORE_INDEX).sum()
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_rows = torch.empty_like(rows)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        for index in torch.arange(rows.shape[0], device=rows.device).chunk(chunks):
            part, wanted = rows[index], target[index]
            logits = nn.functional.linear(part, weight, bias).float()
            counted = wanted != IGNORE_INDEX
            picked = wanted.clamp(min=0).unsqueeze(1)
            total += ((logits.logsumexp(1) - logits.gather(1, picked)[:, 0]) * counted).sum()
            grad = logits.softmax(1).scatter_add_(1, picked, -torch.ones_like(logits[:, :1]))
            grad = grad * (counted.unsqueeze(1) / count)
            grad_rows[index] = (grad.to(part.dtype) @ weight.to(part.dtype)).to(rows.dtype)
            grad_weight += (grad.t().to(part.dtype) @ part).float()
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        ctx.save_for_backward(grad_rows.view_as(hidden), grad_weight.to(weight.dtype),
                              *(() if grad_bias is None else (grad_bias.to(bias.dtype),)))
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        grad_hidden, grad_weight, *grad_bias = ctx.saved_tensors
        scale = grad_loss.to(grad_hidden.dtype)
        return (grad_hidden * scale, grad_weight * scale,
                grad_bias[0] * scale if grad_bias else None, None, None)


def chunked_cross_entropy(head: HeadInput, target: torch.Tensor, chunks: int) -> torch.Tensor:
    """Mean cross-entropy of ``head.logits()`` against ``target`` over the targets not equal
    to ``IGNORE_INDEX``, in fp32, ``chunks`` slices of the rows at a time."""
    return _ChunkedCrossEntropy.apply(head.hidden, head.weight, head.bias, target, chunks)


class ChunkedLoss:
    """The switch on one workload's model; :func:`switch` builds it."""

    def __init__(self, head: nn.Linear, chunks: int) -> None:
        self.head, self.chunks = head, chunks
        head.forward = self._defer  # type: ignore[method-assign]

    def _defer(self, hidden: torch.Tensor) -> HeadInput:
        return HeadInput(hidden, self.head.weight, self.head.bias)

    def loss(self, outputs: Any, target: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(_head_input(outputs), target, self.chunks)


def _head_input(outputs: Any) -> HeadInput:
    """The switched head's return in what the model returned (itself, or a Hugging Face
    output's ``.logits``)."""
    found = outputs if isinstance(outputs, HeadInput) else getattr(outputs, "logits", None)
    if isinstance(found, HeadInput):
        return found
    model_logits(outputs)  # a model with no logits at all: the contract's message
    raise UserError("--loss-chunks: the model did not return its LM head's output.")


def _on_logits(metric: Callable[[Any, torch.Tensor], Any]) -> Callable[[Any, torch.Tensor], Any]:
    def on_logits(outputs: Any, target: torch.Tensor) -> Any:
        return metric(_head_input(outputs).logits(), target)
    return on_logits


def switch(workload: Workload, config: TrainConfig, dims: ParallelDims) -> Workload:
    """The workload training uses under ``--loss-chunks`` (as it is without)."""
    if config.loss_chunks <= 1:
        return workload
    head = lm_head(workload.model)
    default_loss = workload.loss_fn is cross_entropy or (
        getattr(workload.loss_fn, "__qualname__", "") == "lm_loss")
    if head is None or not default_loss:
        raise UserError(f"--loss-chunks: workload {workload.name!r} has no LM head with the "
                        "default cross-entropy to chunk (textlm and hf:DIR have both).")
    if dims.strategy not in CHUNKABLE_STRATEGIES:
        raise UserError(f"--loss-chunks runs the LM head inside the loss, which --strategy "
                        f"{dims.strategy} does not allow: use single or ddp.")
    lever = ChunkedLoss(head, config.loss_chunks)
    return replace(workload, loss_fn=lever.loss,
                   metrics={name: _on_logits(metric)
                            for name, metric in workload.metrics.items()})


def restore(workload: Workload) -> None:
    """The head's own forward back (nothing to do where it was never switched)."""
    head = lm_head(workload.model)
    if head is not None:
        vars(head).pop("forward", None)
