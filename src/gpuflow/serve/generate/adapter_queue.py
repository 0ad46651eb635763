"""Requests under LoRA adapters waiting in the engine core for their adapter's slot, outside
the scheduler (as a constrained request waits for its grammar, ``compiling.py``).

A request naming an adapter enters the scheduler once its adapter holds a slot
(``lora_slots.SlotTable``: read in on first use, into an empty slot or an idle one), which
it pins until it ends; while every slot is pinned it waits here, in arrival order, those
whose adapter is in a slot already going first. One whose adapter was unloaded, or whose
files no longer load, enters only to fail, saying why.
"""

from __future__ import annotations

import collections

from gpuflow.serve.generate.core_request import CoreRequest
from gpuflow.serve.generate.lora_slots import NO_ADAPTER, SlotTable
from gpuflow.serve.generate.messages import Inbox


class AdapterQueue:
    """The core's adapters (``table``; None where none are served) and the requests that
    wait for a slot."""

    def __init__(self, table: SlotTable | None) -> None:
        self.table = table
        self._waiting: collections.deque[CoreRequest] = collections.deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def receive(self, inbox: Inbox) -> None:
        """Adapters registered and unregistered since the last inbox."""
        if self.table is not None:
            for ref in inbox.adapters:
                self.table.register(ref)
            for adapter in inbox.unregistered:
                self.table.forget(adapter)

    def submit(self, request: CoreRequest) -> None:
        self._waiting.append(request)

    def ready(self) -> list[tuple[CoreRequest, str | None]]:
        """The waiting requests whose adapter holds a slot now (``request.slot`` set), or
        that can never have one (with the error they fail with), in arrival order."""
        found = []
        for request in list(self._waiting):
            error = None
            try:
                if self.table is None:
                    raise KeyError(request.adapter)
                slot = self.table.acquire(request.adapter)
            except KeyError:
                slot, error = NO_ADAPTER, "its LoRA adapter was unloaded"
            except Exception as exc:  # files changed or gone since the adapter was checked
                slot, error = NO_ADAPTER, f"its LoRA adapter failed to load ({exc})"
            if slot is not None:
                self._waiting.remove(request)
                request.slot = slot
                found.append((request, error))
        return found

    def drop(self, request_id: int) -> bool:
        """Whether a waiting request of that id was here (now gone)."""
        request = next((r for r in self._waiting if r.id == request_id), None)
        if request is not None:
            self._waiting.remove(request)
        return request is not None

    def clear(self) -> list[CoreRequest]:
        waiting, self._waiting = list(self._waiting), collections.deque()
        return waiting

    def release(self, request: CoreRequest) -> None:
        """A request ended: the slot it held is no longer pinned by it."""
        if request.slot != NO_ADAPTER:
            assert self.table is not None
            self.table.release(request.slot)

    def limits(self) -> dict[str, object]:
        """The slots' limits, for /readyz (none where no adapters are served)."""
        if self.table is None:
            return {}
        slots = self.table.slots
        return {"max_loras": slots.slots, "max_lora_rank": slots.rank,
                "lora_slots_bytes": slots.nbytes()}
