"""Evaluation over the validation set, the same on every strategy."""

from __future__ import annotations

import torch

from gpuflow.data.eval_set import EvalSet
from gpuflow.data.prefetch import move_to_device
from gpuflow.parallel.strategy import Strategy
from gpuflow.precision import PrecisionPolicy
from gpuflow.workload import Ratio, Workload


@torch.no_grad()
def evaluate(strategy: Strategy, eval_set: EvalSet, workload: Workload,
             policy: PrecisionPolicy, device: torch.device, num_workers: int
             ) -> dict[str, float]:
    """Loss and the workload's metrics over ``eval_set``, sample-weighted (a ``Ratio``:
    its parts summed, then divided), as ``val_*``.

    Every rank evaluates the whole set (FSDP needs all ranks in each forward), so each holds
    the same result; under pipelining the last stage computes it and hands it on.
    """
    strategy.model.eval()
    loader = eval_set.loader(workload.collate, num_workers, device.type == "cuda")
    totals: dict[str, float] = {}
    parts: dict[str, list[float]] = {}  # Ratio metrics: numerator and denominator sums
    count = 0
    for batch in loader:
        inputs, target = move_to_device(batch, device, non_blocking=True)
        size = int(target.shape[0])
        with policy.autocast():
            outputs = strategy.eval_outputs(inputs, target)
            if outputs is None:
                continue
            values = {"loss": workload.loss_fn(outputs, target)}
            values.update({name: fn(outputs, target) for name, fn in workload.metrics.items()})
        for name, value in values.items():
            if isinstance(value, Ratio):
                parts[name] = [a + b for a, b in zip(parts.get(name, [0.0, 0.0]), value,
                                                     strict=True)]
            else:
                totals[name] = totals.get(name, 0.0) + float(value) * size
        count += size
    strategy.model.train()
    result = {f"val_{name}": total / count for name, total in totals.items()}
    result.update({f"val_{name}": num / den if den else 0.0
                   for name, (num, den) in parts.items()})
    return strategy.share_eval(result)
