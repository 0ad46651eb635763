"""Worker processes that turn a stream of inputs into outputs in input order, a bounded
number ahead: what packing under a tokenizer runs its tokenizers and chat templates in.

Processes are spawned (never forked from a process holding threads or a model), each set
up once by an initializer. At most ``ahead`` inputs are submitted before their outputs are
taken, so memory holds those and never the stream; an error raised in a worker is raised
here, in order, and leaving the pool cancels what is pending and waits for the rest, so no
process outlives the pack.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from itertools import islice
from typing import Any, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


@contextmanager
def worker_pool(workers: int, initializer: Callable[..., None],
                initargs: tuple[Any, ...]) -> Iterator[ProcessPoolExecutor | None]:
    """``workers`` spawned processes set up by ``initializer(*initargs)``, or None for 0
    (the caller then works in its own process)."""
    pool = None if workers == 0 else ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=initializer,
        initargs=initargs)
    try:
        yield pool
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def in_order(pool: ProcessPoolExecutor, work: Callable[[In], Out], inputs: Iterable[In],
             ahead: int) -> Iterator[Out]:
    """``work(input)`` of each input, computed by the pool's processes with at most
    ``ahead`` submitted and not yet taken, yielded in input order."""
    todo = iter(inputs)
    pending: deque[Future[Out]] = deque(pool.submit(work, item)
                                        for item in islice(todo, ahead))
    while pending:
        result = pending.popleft().result()
        pending.extend(pool.submit(work, item) for item in islice(todo, 1))
        yield result


OrderedMap = Callable[[Callable[[Any], Any], Iterable[Any]], Iterator[Any]]


@contextmanager
def ordered_map(workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...],
                in_flight: int) -> Iterator[OrderedMap]:
    """A ``map(work, inputs)`` in input order over ``workers`` processes set up by
    ``initializer(*initargs)``, ``in_flight`` inputs a worker submitted ahead; with 0
    workers, in this process, set up here once."""
    with worker_pool(workers, initializer, initargs) as pool:
        if pool is None:
            initializer(*initargs)
            yield map
        else:
            yield lambda work, inputs: in_order(pool, work, inputs, in_flight * workers)
