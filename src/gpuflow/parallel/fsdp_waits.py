"""FSDP2's waits for its collectives on CUDA, timed as exposed communication.

On CUDA, FSDP2 all-gathers and reduce-scatters on streams of its own, and the compute stream
stalls only where it waits for one of them: before a unit runs (its all-gather, then the
copy out of the gathered buffer), after a unit's gradients are ready (the copy into the
reduce-scatter buffer, and the wait for the previous unit's reduce-scatter, whose buffer it
reuses) and at the end of backward (every reduce-scatter still running). Events recorded on
the compute stream around those three methods measure how long it stalled there: the
communication compute did not hide, with FSDP's buffer copies.

The methods belong to FSDP's private classes: if a torch version renames them,
``FSDP_WAITS_TIMEABLE`` is False and the run reports its communication as unknown.
Imported only for FSDP on CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import torch
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

_WAITING_METHODS = [(owner, name, getattr(owner, name, None)) for owner, name in (
    (FSDPParamGroup, "wait_for_unshard"), (FSDPParamGroup, "post_backward"),
    (FSDPState, "_root_post_backward_final_callback"))]
FSDP_WAITS_TIMEABLE = all(callable(method) for _, _, method in _WAITING_METHODS)


class TimedFSDPWaits:
    """While entered, FSDP's waiting methods run inside ``timed()``; reusable, one step at a
    time. The root's end-of-backward callback may run a unit's post-backward itself: the
    timer counts nested waits once."""

    def __init__(self, timed: Callable[[], AbstractContextManager[None]]) -> None:
        self._timed = [(owner, name, self._timing(method, timed))
                       for owner, name, method in _WAITING_METHODS]

    @staticmethod
    def _timing(method: Callable[..., Any], timed: Callable[[], AbstractContextManager[None]]
                ) -> Callable[..., Any]:
        # FSDP's hooks run eagerly around compiled blocks; so must the events around them.
        @torch.compiler.disable
        @functools.wraps(method)
        def timed_method(*args: Any, **kwargs: Any) -> Any:
            with timed():
                return method(*args, **kwargs)

        return timed_method

    def __enter__(self) -> None:
        for owner, name, method in self._timed:
            setattr(owner, name, method)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for owner, name, method in _WAITING_METHODS:
            setattr(owner, name, method)
