"""Whole replicas on every rank (``--strategy ddp``): DDP all-reduces gradient buckets while
backward still runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gpuflow.parallel.single import Single
from gpuflow.parallel.strategy import ModelParts


class Replicated(Single):
    """DDP: the step's exposed communication is what is left of the last bucket's
    all-reduce when backward ends, timed from the bucket hook."""

    def wrap(self, model: nn.Module, parts: ModelParts) -> nn.Module:
        self._ddp = apply_ddp(super().wrap(model, parts), self.device,
                              on_bucket_ready=self.timer.comm.begin,
                              bucket_mb=self.dims.bucket_mb)
        return self._ddp

    def no_backward_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if last else self._ddp.no_sync()


def apply_ddp(model: nn.Module, device: torch.device,
              on_bucket_ready: Callable[[], None] | None = None,
              bucket_mb: float | None = None) -> DistributedDataParallel:
    """Gradients are bucketed and all-reduced while backward is still running.

    A bucket is all-reduced once backward has filled it. Buckets hold ``bucket_mb`` MiB of
    gradients; by default PyTorch's 25, except the first (the last parameters' gradients,
    which backward reaches first) with 1. What is left to reduce when backward ends is
    exposed: about the last bucket, unless the link falls behind.

    ``on_bucket_ready`` is called as each bucket's all-reduce is launched; the last call of a
    backward marks the end of its gradient compute, so the time from there until backward
    returns is communication that nothing overlapped.
    """
    device_ids = [device.index] if device.type == "cuda" else None
    # Gradients live in the communication buckets: no copy into them, less memory.
    ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                  bucket_cap_mb=bucket_mb)
    if on_bucket_ready is not None:
        # No annotations: DDP compares them to dist.GradBucket, and postponed ones are strings.
        def timed_allreduce(state, bucket):
            on_bucket_ready()
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, timed_allreduce)
    return ddp
