"""Move batches to the device ahead of use, so the step never waits for the copy."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


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
    the batch is passed through unchanged.
    """

    def __init__(self, batches: Iterable[Any], device: torch.device) -> None:
        self._source = iter(batches)
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
