"""Where an engine step's forward runs: a thread of its own in the engine core, the
"device thread", so that the core's host work overlaps the forward.

A step whose rows are all greedy (``CoreRequest.device_sampled``) is launched and left in
flight: its next tokens are chosen by one argmax on the device and stay there, the
scheduler plans the next step from placeholders (``core_request.PENDING``), and the next
step reads those tokens from the device (``Patch``) before the host ever sees them. Only
then does the core wait for the first step's tokens, check its finishes and report it:
scheduling, building and launching step N+1 overlap step N's forward, and reporting step
N overlaps step N+1's. On a GPU the thread launches kernels (or replays a CUDA graph) while
the core's thread works; on a CPU torch's operators release the GIL, so the same overlap
holds for the forward's compute. Steps that need their logits on the host (sampling,
penalties, log-probabilities, drafts to verify) are waited for at once, as before.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from gpuflow.serve.generate.paged import RowSpec
from gpuflow.serve.generate.runner import ModelRunner
from gpuflow.serve.generate.sampling import greedy_ids
from gpuflow.serve.generate.scheduler import Chunk, Plan, Sequence
from gpuflow.serve.generate.speculate import Draft

Result = TypeVar("Result")


class DeviceThread:
    """One thread that runs the forwards, in order, under the engine's context (inference
    mode, autocast), entered once for the thread's life."""

    def __init__(self, context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self._held = threading.local()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpuflow-device",
                                            initializer=self._enter, initargs=(context,))

    def _enter(self, context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self._held.stack = contextlib.ExitStack()
        self._held.stack.enter_context(context())

    def submit(self, work: Callable[..., Result], *args: Any) -> Future[Result]:
        return self._executor.submit(work, *args)

    def call(self, work: Callable[..., Result], *args: Any) -> Result:
        return self.submit(work, *args).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class Forward:
    """What a step's forward gave: each row's logits (none kept for a step left in
    flight), its final rows' greedy tokens on the device (a step left in flight), the
    seconds the runner's call took, and whether it replayed a CUDA graph."""

    logits: list[torch.Tensor]
    tokens: torch.Tensor | None
    forward_s: float
    graphed: bool


@dataclass(frozen=True)
class Launched:
    """A step handed to the device thread: its plan, its rows (one-token rows first) with
    their chunks, its drafts, the rows whose chunk ends its sequence (``finals``: a next
    token each), whether it is left in flight (``in_flight``), and its forward."""

    plan: Plan
    steps: list[tuple[RowSpec, Chunk]]
    drafts: dict[Sequence, Draft]
    finals: list[int]
    in_flight: bool
    started: float
    forward: Future[Forward]


def run_forward(runner: ModelRunner, rows: list[RowSpec], patch_rows: list[int],
                source: Future[Forward] | None, source_index: torch.Tensor | None,
                finals: list[int], greedy: bool) -> Forward:
    """In the device thread: the step's forward, the placeholder tokens of ``patch_rows``
    read from the step before's device tokens (``source``, done before this in the same
    thread), and for a step left in flight its final rows' argmaxes (their logits are the
    step's only ones: every row of such a step wants its last token's, or none)."""
    started = time.perf_counter()
    patch = None
    if patch_rows:
        assert source is not None and source_index is not None
        earlier = source.result().tokens
        assert earlier is not None
        patch = (patch_rows, earlier[source_index.to(earlier.device, non_blocking=True)])
    if not greedy:
        logits = runner.run(rows, patch)
        return Forward(logits, None, time.perf_counter() - started, runner.graphed)
    last = runner.run_flat(rows, patch)
    forward_s = time.perf_counter() - started
    assert last.shape[0] == len(finals)
    return Forward([], greedy_ids(last) if finals else None, forward_s, runner.graphed)
