"""``--batch-size auto``: the largest micro-batch whose training step really fits.

The probe runs the caller's step at growing micro-batches (doubling, then bisecting between
the last fit and the first failure). A failure is an out-of-memory error: on CUDA the
allocator's own; on a CPU, where allocation does not fail, a byte budget enforced by torch's
``MemTracker`` (every tensor the step creates, plus the tracked model and optimizer, counted
as it is allocated and freed). After a failure the step's tensors are released (gradients
dropped, ``gc``, ``torch.cuda.empty_cache()``) before the next try, so a failed probe leaves
no memory behind.

Limits under FSDP: each rank probes its own memory and all ranks must run the same sizes, so
the caller reduces each result with a MIN all-reduce (``agree``) before acting on it; an OOM
raised inside a collective on one rank only leaves the others waiting, so the probe should
run where all ranks fail alike (same shapes on identical devices).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from gpuflow.errors import UserError


class MemoryBudgetExceeded(torch.OutOfMemoryError):
    """Raised by :func:`memory_budget` when tracked memory passes the budget."""


class _NoHook:
    """Stands for the gradient hooks of a frozen parameter, which has none to remove."""

    def remove(self) -> None:
        pass


class FrozenTolerantTracker(MemTracker):
    """MemTracker for a model with frozen parameters (a LoRA run's base): MemTracker hooks
    every parameter's gradient as a module runs, and torch refuses a hook on a frozen one,
    so those count as hooked, with no hook."""

    def _track_module_params_and_buffers(self, module: nn.Module,
                                         install_grad_hooks: bool = True) -> tuple[int, int]:
        for param in module.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


class _BudgetTracker(FrozenTolerantTracker):
    """A tracker that fails an allocation taking its device over ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = super().__torch_dispatch__(func, types, args, kwargs)
        for device, snapshot in self._curr_mem_snap.items():
            if snapshot["Total"] > self.budget:
                raise MemoryBudgetExceeded(
                    f"{snapshot['Total']} bytes on {device} exceed the budget of {self.budget}")
        return result


@contextlib.contextmanager
def memory_budget(budget: int, *tracked: nn.Module | torch.optim.Optimizer) -> Iterator[None]:
    """Fail (``MemoryBudgetExceeded``) when the tensors of ``tracked`` and of the block
    exceed ``budget`` bytes on any device."""
    tracker = _BudgetTracker(budget)
    tracker.track_external(*tracked)
    with tracker:
        yield


def _release(tracked: Sequence[nn.Module | torch.optim.Optimizer]) -> None:
    for obj in tracked:
        obj.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_max_batch_size(step: Callable[[int], None], *, device: torch.device | str = "cpu",
                        tracked: Sequence[nn.Module | torch.optim.Optimizer] = (),
                        memory_cap: int | None = None, start: int = 1, limit: int = 4096,
                        agree: Callable[[int], int] | None = None) -> int:
    """The largest micro-batch in [``start``, ``limit``] for which ``step(n)`` runs.

    ``step(n)`` runs one forward and backward (and the optimizer step, if it should count) at
    micro-batch ``n``. ``tracked`` are the model and optimizer: their gradients are dropped
    after every try. On a CPU ``memory_cap`` (bytes) is required. ``agree`` turns each rank's
    verdict into the job's (a MIN all-reduce under FSDP/DDP). Raises UserError if even
    ``start`` does not fit.
    """
    device = torch.device(device)
    if device.type != "cuda" and memory_cap is None:
        raise UserError("--batch-size auto on a CPU needs a memory cap: a CPU never runs out "
                        "of memory the way a GPU does, it swaps.")

    def fits(size: int) -> bool:
        budget = (memory_budget(memory_cap, *tracked) if memory_cap is not None
                  else contextlib.nullcontext())
        try:
            with budget:
                step(size)
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        finally:
            _release(tracked)
        return bool(agree(int(ok))) if agree is not None else ok

    if not fits(start):
        raise UserError(f"Not even a micro-batch of {start} fits in memory.")
    good, bad = start, None
    while bad is None and good < limit:
        trial = min(2 * good, limit)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def accumulation_for(global_batch: int, data_parallel: int, max_micro: int) -> tuple[int, int]:
    """(micro-batch, accumulation) keeping ``global_batch``: the largest micro-batch that is
    at most ``max_micro`` and divides the per-replica batch."""
    if global_batch % data_parallel:
        raise UserError(f"The global batch {global_batch} does not divide over "
                        f"{data_parallel} data-parallel ranks.")
    per_rank = global_batch // data_parallel
    micro = max(d for d in range(1, min(per_rank, max_micro) + 1) if per_rank % d == 0)
    return micro, per_rank // micro
