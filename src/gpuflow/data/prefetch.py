"""Batches ready ahead of use: loaded by a background thread and copied to the device,
so the step waits for neither."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_DONE = object()


def resize_rows(tree: Any, rows: int) -> Any:
    """Every tensor in ``tree`` cut or padded (repeating its last row) to ``rows`` rows.

    A traced pipeline runs fixed micro-batch shapes: the trace needs an example of exactly
    one micro-batch, and a short last evaluation batch is padded up to a full one.
    """
    def resize(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape[0] >= rows:
            return tensor[:rows]
        padding = tensor[-1:].expand(rows - tensor.shape[0], *tensor.shape[1:])
        return torch.cat([tensor, padding])

    return torch.utils._pytree.tree_map_only(torch.Tensor, resize, tree)


class BackgroundLoader:
    """Runs a batch iterator ``depth`` batches ahead in a thread.

    Loading in the training process (no DataLoader workers) is Python work that the GIL
    lets overlap with the step, whose kernels release it: the next batch is being read and
    collated while this one computes. Order and contents are those of the iterator itself.
    """

    def __init__(self, batches: Iterable[Any], depth: int = 2) -> None:
        self._source = iter(batches)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuflow-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch in self._source:
                if not self._put(batch):
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


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Recursively move tensors in tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple | list):
        return type(batch)(move_to_device(item, device, non_blocking) for item in batch)
    if isinstance(batch, dict):
        return {key: move_to_device(value, device, non_blocking) for key, value in batch.items()}
    return batch


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, tuple | list):
        for item in batch:
            _record_stream(item, stream)
    elif isinstance(batch, dict):
        for item in batch.values():
            _record_stream(item, stream)


class DevicePrefetcher:
    """Iterates batches already on the device, one batch ahead of the consumer.

    On CUDA the copy of batch k+1 runs on a side stream (from pinned memory) while step k
    computes; the consumer's stream waits on it only when it takes the batch. On the CPU
    the batch is passed through unchanged. ``background`` also loads the batches in a
    thread (for loading in this process; DataLoader workers already load ahead).
    """

    def __init__(self, batches: Iterable[Any], device: torch.device,
                 background: bool = False) -> None:
        self._loader = BackgroundLoader(batches) if background else None
        self._source = self._loader if self._loader is not None else iter(batches)
        self._device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._next: Any = None
        self._exhausted = False
        self._preload()

    def _preload(self) -> None:
        try:
            batch = next(self._source)
        except StopIteration:
            self._exhausted = True
            self._next = None
            return
        if self._stream is None:
            self._next = move_to_device(batch, self._device)
            return
        with torch.cuda.stream(self._stream):
            self._next = move_to_device(batch, self._device, non_blocking=True)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._exhausted:
            raise StopIteration
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_stream(self._stream)
            _record_stream(self._next, current)
        batch = self._next
        self._preload()
        return batch

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
