"""Batches ready ahead of use: loaded by a background thread and copied to the device,
so the step waits for neither."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

_DONE = object()


class BackgroundLoader:
    """Runs a batch iterator ``depth`` batches ahead in a thread.

    Loading in the training process (no DataLoader workers) is Python work that the GIL
    lets overlap with the step, whose kernels release it: the next batch is being read and
    collated while this one computes. Order and contents are those of the iterator itself;
    ``transform`` (e.g. the copy to the device) also runs in the thread.
    """

    def __init__(self, batches: Iterable[Any], depth: int = 2,
                 transform: Callable[[Any], Any] | None = None) -> None:
        self._source = iter(batches)
        self._transform = transform
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuflow-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch in self._source:
                if not self._put(self._transform(batch) if self._transform else batch):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put(exc)
            return
        self._put(_DONE)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the thread; batches it loaded ahead are dropped."""
        self._stop.set()
        self._thread.join()


@runtime_checkable
class MovesItself(Protocol):
    """A batch that makes its device form itself, e.g. by decoding encoded images there
    (``gpuflow.data.image_device_batches``); it runs where the copy would, on the copy's
    stream."""

    def to_device(self, device: torch.device, non_blocking: bool = False) -> Any: ...


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Recursively move tensors in tuples, lists and mappings (a ``BatchEncoding`` too,
    which arrives as a plain dict: models are called with any mapping as keywords); a
    ``MovesItself`` batch moves itself."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, MovesItself):
        return batch.to_device(device, non_blocking)
    if isinstance(batch, tuple | list):
        return type(batch)(move_to_device(item, device, non_blocking) for item in batch)
    if isinstance(batch, Mapping):
        return {key: move_to_device(value, device, non_blocking) for key, value in batch.items()}
    return batch


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, tuple | list):
        for item in batch:
            _record_stream(item, stream)
    elif isinstance(batch, Mapping):
        for item in batch.values():
            _record_stream(item, stream)


class DevicePrefetcher:
    """Iterates batches already on the device, ahead of the consumer.

    On CUDA the copy of the next batch runs on a side stream (from pinned memory) while the
    step computes; the consumer's stream waits on it only when it takes the batch. On the
    CPU the batch is passed through unchanged. ``background`` also loads the batches in a
    thread (for loading in this process; DataLoader workers already load ahead), and the
    copies are issued from that thread too, so taking a batch costs the step nothing more
    than a queue hand-off and a stream wait. Batches that move themselves (``MovesItself``:
    JPEGs decoded on the device) always move in that thread, so that their decode overlaps
    the step rather than delaying its launch.
    """

    def __init__(self, batches: Iterable[Any], device: torch.device,
                 background: bool = False) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        source: Iterator[Any] = iter(batches)
        if not background:  # peek: the first batch is loaded here either way
            first = next(source, _DONE)
            source = itertools.chain([] if first is _DONE else [first], source)
            background = isinstance(first, MovesItself)
        self._loader = (BackgroundLoader(source, transform=self._to_device) if background
                        else None)
        self._source = self._loader if self._loader is not None else source
        self._next: Any = None
        self._exhausted = False
        if self._loader is None:
            self._preload()

    def _to_device(self, batch: Any) -> tuple[Any, torch.cuda.Event | None]:
        """The batch on the device, and the event its copy completes at (CUDA only)."""
        if self._stream is None:
            return move_to_device(batch, self._device), None
        with torch.cuda.stream(self._stream):
            moved = move_to_device(batch, self._device, non_blocking=True)
            return moved, self._stream.record_event()

    def _preload(self) -> None:
        try:
            self._next = self._to_device(next(self._source))
        except StopIteration:
            self._exhausted = True
            self._next = None

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._loader is not None:
            batch, copied = next(self._loader)
        else:
            if self._exhausted:
                raise StopIteration
            batch, copied = self._next
            self._preload()
        if copied is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(copied)
            _record_stream(batch, current)
        return batch

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
