"""Where torch waits for a parallelism's collectives, timed as exposed communication.

FSDP2, DTensor and the pipeline schedules each wait for their collectives in a few functions
of torch's own. For the length of a step, :class:`TimedWaits` swaps those for versions that
run inside a timer. On the CPU a wait holds the host until its collective is done; on CUDA
it makes the compute stream wait for the collective's stream, and events recorded on the
compute stream around it measure that stall. Either way what is timed is the communication
compute did not hide. A torch version that renames one of these functions leaves that
parallelism's communication unknown (:func:`timeable`), never mismeasured.

Each list of waits imports only its own parallelism's modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

# A function to time: the module or class that holds it, and its name there.
Wait = tuple[Any, str]
Timer = Callable[[], AbstractContextManager[None]]


def fsdp_waits() -> list[Wait]:
    """FSDP2's compute stream waits before a unit runs (its all-gather, then the copy out of
    the gathered buffer), after a unit's gradients are ready (the copy into the
    reduce-scatter buffer, and the previous unit's reduce-scatter, whose buffer it reuses)
    and at the end of backward (every reduce-scatter still running). On the CPU its
    collectives run before these waits, so they are timed there instead
    (``gpuflow.telemetry.host_collectives``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return [(FSDPParamGroup, "wait_for_unshard"), (FSDPParamGroup, "post_backward"),
            (FSDPState, "_root_post_backward_final_callback")]


def functional_collective_waits() -> list[Wait]:
    """DTensor's redistributions issue functional collectives and wait for each where its
    result is first used, in forward and in backward (not in compiled code, which waits
    inside its graph)."""
    import torch.distributed._functional_collectives as funcol

    return [(funcol, "wait_tensor")]


def pipeline_waits() -> list[Wait]:
    """Every pipeline schedule waits for its batches of sends and receives here. A receive
    waits for the neighbouring stage to send, so this is the transfers and the pipeline's
    bubble together."""
    from torch.distributed.pipelining import schedules

    return [(schedules, "_wait_batch_p2p")]


def timeable(waits: Sequence[Wait]) -> bool:
    return all(callable(getattr(owner, name, None)) for owner, name in waits)


class TimedWaits:
    """While entered, each of ``waits`` runs inside ``timed()``; reusable, one step at a time.
    A wait may run inside another (FSDP's end-of-backward callback runs a unit's
    post-backward itself): the timer must count such time once."""

    def __init__(self, waits: Sequence[Wait], timed: Timer) -> None:
        self._untimed = [(owner, name, getattr(owner, name)) for owner, name in waits]
        self._timed = [(owner, name, _timing(function, timed))
                       for owner, name, function in self._untimed]

    def __enter__(self) -> None:
        for owner, name, function in self._timed:
            setattr(owner, name, function)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for owner, name, function in self._untimed:
            setattr(owner, name, function)


def _timing(function: Callable[..., Any], timed: Timer) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed_function(*args: Any, **kwargs: Any) -> Any:
        with timed():
            return function(*args, **kwargs)

    return timed_function
