"""Dynamic batching on asyncio: a bounded queue, deadlines enforced while waiting.

Requests carrying rows and a batching key wait in a FIFO queue. The batch is led by the
oldest request and runs as soon as the model is free: a request that finds the model idle
and nobody else on the way runs at once, and batches form from what arrives while a batch
runs. It waits for company only while other requests are already on their way in (being
read and decoded, ``incoming()``), and then at most ``max_wait_s``, or until its key fills
``max_batch_size`` rows.

Batches run in a worker thread, one at a time, so the event loop stays free to accept
requests and fire deadlines. A request that finds the model idle is dispatched by a
callback of its own, without a turn of the batching task, once the requests read in the
same turn of the event loop have been queued too (those make a batch with it). Alone, it
goes to the thread, or, while its key's lone runs take less than ``inline_below_s`` (a
running estimate), runs on the event loop itself, as a plain endpoint's would: the
hand-off to a thread and back (two wake-ups and a GIL hand-over) costs a good share of a
sub-millisecond batch, while holding the loop that briefly delays nobody much.

Unlike queues that check deadlines only on dequeue, each request's deadline is a timer:
when it fires, the request leaves the queue at once and its caller gets
``DeadlineExceeded``. A caller that is cancelled (its client went away) also leaves the
queue. A batch that raises fails only its own requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

RunFn = Callable[[Hashable, list[Any]], list[Any]]
INLINE_BELOW_MS = 1.0  # `gpuflow serve --inline-below-ms`
LONE_SMOOTHING = 0.25  # weight of the newest lone run in its key's running estimate


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already."""


class DeadlineExceeded(Exception):
    """The request's deadline passed while it waited in the queue."""


class BatchFailed(Exception):
    """The batch this request ran in raised; ``__cause__`` holds the error."""


class Observer(Protocol):
    def batch_formed(self, rows: int) -> None: ...
    def queue_changed(self, depth: int) -> None: ...


@dataclass(frozen=True)
class Result:
    outputs: list[Any]
    queue_s: float
    compute_s: float
    batch_rows: int


@dataclass(eq=False)
class _Pending:
    key: Hashable
    rows: list[Any]
    future: asyncio.Future[Result]
    enqueued: float = field(default_factory=time.monotonic)
    timer: asyncio.TimerHandle | None = None


class Batcher:
    def __init__(self, run: RunFn, max_batch_size: int, max_wait_s: float, max_queue: int,
                 observer: Observer | None = None, inline_below_s: float = 0.0) -> None:
        self.run = run
        self.inline_below_s = inline_below_s
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.observer = observer
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuflow-batch")
        self._queue: dict[_Pending, None] = {}  # insertion-ordered, O(1) removal
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._incoming = 0
        self._busy = False  # a batch is in the worker thread
        self._lone_s: dict[Hashable, float] = {}  # each key's lone batch run time

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        """Whether a new request could not be queued even if every one on its way in were
        refused: the place to refuse it before reading its body."""
        return len(self._queue) + self._incoming >= self.max_queue

    @contextlib.contextmanager
    def incoming(self) -> Iterator[None]:
        """A request on its way in (its body being read and decoded): a partial batch may
        wait for it, up to ``max_wait_s``."""
        self._incoming += 1
        try:
            yield
        finally:
            self._incoming -= 1
            self._arrived.set()  # one fewer to wait for

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for pending in list(self._queue):
            self._remove(pending)
            pending.future.cancel()
        self.executor.shutdown(wait=True)

    def submit(self, key: Hashable, rows: list[Any], timeout_s: float
               ) -> asyncio.Future[Result]:
        """Queue ``rows`` now (no batch can start between this and the end of the caller's
        ``incoming()``) and return the future of their outputs, which fails with
        DeadlineExceeded or BatchFailed; raises QueueFull. Cancelling the future takes the
        request out of the queue."""
        if not 0 < len(rows) <= self.max_batch_size:
            raise ValueError(f"a request holds 1 to {self.max_batch_size} rows")
        if len(self._queue) >= self.max_queue:
            raise QueueFull
        loop = asyncio.get_running_loop()
        pending = _Pending(key, rows, loop.create_future())
        pending.timer = loop.call_later(timeout_s, self._expire, pending)
        pending.future.add_done_callback(lambda _: self._remove(pending))
        idle = not self._busy and not self._queue
        self._queue[pending] = None
        self._changed()
        if idle:
            # After the requests already read in this turn of the loop have been queued
            # too: they make a batch; alone, it runs now.
            loop.call_soon(self._run_if_alone, pending)
        else:
            self._arrived.set()
        return pending.future

    def _run_if_alone(self, pending: _Pending) -> None:
        """Run a request that found the model idle, unless others joined it meanwhile or
        are on their way in: then the batching task forms their batch."""
        if self._busy or self._incoming or list(self._queue) != [pending]:
            self._arrived.set()
            return
        self._remove(pending)
        if self._lone_s.get(pending.key, float("inf")) < self.inline_below_s:
            self._run_inline(pending)
        else:
            self._launch(pending.key, [pending])

    def _remove(self, pending: _Pending) -> None:
        if pending.timer is not None:
            pending.timer.cancel()
        if pending in self._queue:
            del self._queue[pending]
            self._changed()

    def _expire(self, pending: _Pending) -> None:
        if pending in self._queue:
            self._remove(pending)
            if not pending.future.done():
                pending.future.set_exception(DeadlineExceeded())

    def _changed(self) -> None:
        if self.observer is not None:
            self.observer.queue_changed(len(self._queue))

    def _ready_rows(self, key: Hashable) -> int:
        return sum(len(p.rows) for p in self._queue if p.key == key)

    async def _loop(self) -> None:
        while True:
            if not self._queue or self._busy:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            first = next(iter(self._queue))
            closes = first.enqueued + self.max_wait_s
            while (first in self._queue and self._incoming > 0
                   and self._ready_rows(first.key) < self.max_batch_size):
                remaining = closes - time.monotonic()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:
                    break
            if first in self._queue:
                await asyncio.wait([self._launch(first.key, self._take(first.key))])

    def _take(self, key: Hashable) -> list[_Pending]:
        batch, rows = [], 0
        for pending in list(self._queue):
            if pending.key == key and rows + len(pending.rows) <= self.max_batch_size:
                self._remove(pending)
                batch.append(pending)
                rows += len(pending.rows)
        return batch

    def _rows(self, batch: list[_Pending]) -> list[Any]:
        rows = [row for pending in batch for row in pending.rows]
        if self.observer is not None:
            self.observer.batch_formed(len(rows))
        return rows

    def _run_inline(self, pending: _Pending) -> None:
        """Run a lone request's batch here, on the event loop, and settle its future."""
        done: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        rows, start = self._rows([pending]), time.monotonic()
        try:
            done.set_result(self._timed_run(pending.key, rows, 1))
        except Exception as exc:
            done.set_exception(exc)
        self._finish([pending], len(rows), start, done)

    def _timed_run(self, key: Hashable, rows: list[Any], requests: int) -> list[Any]:
        """``run``, timing a lone request's batch by itself (not its hand-offs); the
        estimate is smoothed so that one slow call does not flip the choice back and forth."""
        start = time.monotonic()
        outputs = self.run(key, rows)
        if requests == 1:
            took = time.monotonic() - start
            last = self._lone_s.get(key, took)
            self._lone_s[key] = last + LONE_SMOOTHING * (took - last)
        return outputs

    def _launch(self, key: Hashable, batch: list[_Pending]) -> asyncio.Future[list[Any]]:
        """Hand the batch to the worker thread; its requests get their results when it
        returns (``_finish``)."""
        rows = self._rows(batch)
        self._busy = True
        start = time.monotonic()
        done = asyncio.wrap_future(self.executor.submit(self._timed_run, key, rows,
                                                        len(batch)))
        done.add_done_callback(lambda _: self._finish(batch, len(rows), start, done))
        return done

    def _finish(self, batch: list[_Pending], rows: int, start: float,
                done: asyncio.Future[list[Any]]) -> None:
        self._busy = False
        if self._queue:
            self._arrived.set()  # the model is free for what queued meanwhile
        compute_s = time.monotonic() - start
        try:
            outputs = done.result()
            if len(outputs) != rows:
                raise RuntimeError(f"the model returned {len(outputs)} outputs for "
                                   f"{rows} rows")
        except asyncio.CancelledError:  # the batcher stopped before the batch ran
            for pending in batch:
                pending.future.cancel()
            return
        except Exception as exc:
            for pending in batch:
                if not pending.future.done():
                    error = BatchFailed(f"{type(exc).__name__}: {exc}")
                    error.__cause__ = exc
                    pending.future.set_exception(error)
            return
        offset = 0
        for pending in batch:
            count = len(pending.rows)
            if not pending.future.done():  # its client may have gone meanwhile
                pending.future.set_result(Result(outputs[offset:offset + count],
                                                 start - pending.enqueued, compute_s, rows))
            offset += count
