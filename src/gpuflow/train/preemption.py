"""Stop cleanly when the cluster reclaims the job: checkpoint, then exit for a requeue.

Slurm (``--signal=USR1@90``), Kubernetes, spot reclaims and torch's elastic agent send
SIGTERM or SIGUSR1 some seconds before SIGKILL. The handler only notes the signal; the
step in progress finishes, and the note rides on the all-reduce every step already makes
for its loss (:meth:`Preemption.mean_loss`), so all ranks agree on the step to stop at with
no extra host sync. The trainer then writes a checkpoint and raises
:class:`~gpuflow.errors.Preempted` (exit code 75, docs/checkpoints.md). A second signal
during the save is noted and ignored: the save is never interrupted.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from gpuflow.errors import Preempted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """The stop signals' handler while a run trains, and the ranks' agreement to stop."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.received: signal.Signals | None = None
        self.stop_agreed = False
        self._owner = os.getpid()

    @contextmanager
    def handling(self) -> Iterator[None]:
        """SIGTERM and SIGUSR1 are noted instead of ending the process, until the block
        ends (a handler can only be set from the main thread; elsewhere nothing changes)."""
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._note) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # A forked data-loader worker inherits this handler: it ignores the signal.
        if os.getpid() == self._owner and self.received is None:
            self.received = signal.Signals(signum)

    def mean_loss(self, mean: Callable[[torch.Tensor], torch.Tensor],
                  loss: torch.Tensor) -> float:
        """The step's loss through ``mean`` (the strategy's all-reduce over ranks), this
        rank's stop flag folded into the same collective: after it every rank knows
        whether any rank was signalled."""
        if not self.enabled:
            return mean(loss).item()
        loss = loss.reshape(())
        flag = loss.new_full((), 1.0 if self.received is not None else 0.0)
        value, stop = mean(torch.stack([loss, flag])).tolist()
        self.stop_agreed = stop > 0
        return value

    def stop(self, step: int, save: Callable[[], Path],
             log: Callable[[dict[str, Any]], None]) -> Preempted:
        """Save at ``step`` (every rank, as the layout needs); the exception that ends the
        run, with how long the save took."""
        started = time.perf_counter()
        path = save()
        seconds = time.perf_counter() - started
        name = self.received.name if self.received is not None else "a signal to another rank"
        log({"event": "preempted", "step": step, "signal": name, "save_s": seconds})
        return Preempted(f"stopped by {name} after step {step}; checkpoint {path} written in "
                         f"{seconds:.2f} s. Continue with `gpuflow train --resume "
                         f"{path.parent.parent}`.")
