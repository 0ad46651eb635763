"""The generation engine as the server sees it: requests in, events out, the engine core
(``core.py``) behind a link (``link.py``: a thread here, or a process of its own).

``submit`` makes a ``Generation`` (on the event loop) and queues it for the core; what the
event loop queues in one turn (new requests, drops) crosses to the core as one ``Inbox``.
Each step's ``Report`` comes back whole and is handed to the event loop with one wake-up,
where each request turns its tokens into text events (``requests.py``): detokenizing and
stop strings happen here, beside HTTP, not in the core. A request a stop string ends is
dropped from the core at its next step. If the core dies, every open request fails with a
clear message and ``on_death`` tells the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from gpuflow.errors import UserError
from gpuflow.serve.generate.adapter_files import AdapterRef, AdapterRegistry
from gpuflow.serve.generate.core import EngineCore
from gpuflow.serve.generate.grammar import Grammars, Vocabulary
from gpuflow.serve.generate.messages import (
    Inbox,
    NewRequest,
    Occupancy,
    Output,
    Ready,
    Report,
    WarmUpFailed,
)
from gpuflow.serve.generate.requests import EngineObserver, Event, Failed, Generation, WaitingFull
from gpuflow.serve.generate.sampling import SamplingParams
from gpuflow.serve.generate.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger("gpuflow.serve")


class Link(Protocol):
    where: str  # where the core runs, for /readyz

    def start(self, on_report: Callable[[Report], None],
              on_exit: Callable[[str], None]) -> None: ...
    def send(self, inbox: Inbox) -> None: ...
    def ready(self, timeout: float) -> Ready | WarmUpFailed | None: ...
    def stop(self) -> None: ...


class CoreDied(RuntimeError):
    """The engine core's process exited: no request can be served."""


class GenerationEngine:
    """Submits requests to the engine core and hands their events to the event loop."""

    def __init__(self, link: Link, context: int, vocab_size: int, max_queue: int,
                 tokenizer: Tokenizer | None = None,
                 observer: EngineObserver | None = None) -> None:
        self.link, self.context, self.vocab_size = link, context, vocab_size
        self.max_queue = max_queue
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.observer = observer
        self.on_death: Callable[[str], None] | None = None  # the server's, when set
        self.death: str | None = None
        self.ready_info: Ready | None = None
        self._ids = itertools.count()
        self._live: dict[int, Generation] = {}
        self._lock = threading.Lock()  # _live: the event loop's, and the report reader's
        self._pending_new: list[NewRequest] = []
        self._pending_drops: list[int] = []
        self._flush_scheduled = False
        self._submitted = 0
        self._taken = 0  # requests the core had taken in at its last report
        self.occupancy = Occupancy(0, 0, 0, 0, 0, 0, 0)  # the core's, at its last report
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()  # built in the first compile's thread
        self._vocabulary_sent = False
        self.adapters: AdapterRegistry | None = None  # LoRA adapters, when served
        self._pending_adapters: list[AdapterRef] = []
        self._pending_unregistered: list[int] = []
        self._started = False

    @property
    def grammars(self) -> Grammars:
        """Grammars compiled against the served vocabulary here, in the server, so that a
        bad one is refused before it queues; built on first use (~0.5 s for 49k tokens)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(Vocabulary.of(self.tokenizer, self.vocab_size))
            return self._grammars

    @property
    def core(self) -> EngineCore:
        """The core, when it runs in this process (``ThreadLink``)."""
        core = getattr(self.link, "core", None)
        if core is None:
            raise AttributeError("the engine core runs in a process of its own")
        return core

    @property
    def active(self) -> int:
        """Sequences holding KV blocks, at the core's last report."""
        return self.occupancy.running

    @property
    def waiting(self) -> int:
        """Requests waiting to start: the core's at its last report, and those sent since."""
        return self.occupancy.waiting + self._submitted - self._taken

    @property
    def warmup_s(self) -> float | None:
        """Seconds the decode warm-up took, once done."""
        return None if self.ready_info is None else self.ready_info.warmup_s

    def describe(self) -> str:
        """How decode steps run, e.g. ``decode compiled for batch buckets 1,2,4``."""
        if self.ready_info is not None:
            return self.ready_info.decode
        core = getattr(self.link, "core", None)  # a core in this process says it before
        return "warming up" if core is None else core.runner.describe()

    def limits(self) -> dict[str, Any]:
        """The pool's and the scheduler's limits, and where the core runs, for /readyz."""
        limits = {} if self.ready_info is None else dict(self.ready_info.limits)
        return {**limits, "engine_core": self.link.where}

    def start(self) -> None:
        self.link.start(self._on_report, self._on_exit)
        self._started = True
        if self._pending_adapters:  # registered before the core started (--lora)
            self.link.send(Inbox(adapters=tuple(self._pending_adapters)))
            self._pending_adapters = []

    def serve_adapters(self, registry: AdapterRegistry) -> None:
        """Serve LoRA adapters: those ``registry`` holds now, and those registered later."""
        self.adapters = registry
        self._pending_adapters += list(registry)
        self._flush_if_running()

    def register_adapter(self, name: str, path: str) -> AdapterRef:
        """Serve the LoRA adapter in ``path`` as ``name`` (``AdapterRegistry.add``); the
        core hears of it before any request for it."""
        assert self.adapters is not None, "adapters are served with max_loras > 0"
        ref = self.adapters.add(name, path)
        self._pending_adapters.append(ref)
        self._flush_if_running()
        return ref

    def unregister_adapter(self, name: str) -> AdapterRef:
        """Stop serving the adapter ``name`` (``KeyError`` if none): requests under it that
        the core runs already finish, those that wait for its slot fail."""
        assert self.adapters is not None, "adapters are served with max_loras > 0"
        ref = self.adapters.remove(name)
        self._pending_unregistered.append(ref.id)
        self._flush_if_running()
        return ref

    def _flush_if_running(self) -> None:
        """Send what is pending at the event loop's next turn, once the core runs (before,
        ``start`` sends it)."""
        if self._started:
            self._flush_soon(asyncio.get_running_loop())

    def wait_warm(self, timeout: float | None = None) -> float:
        """Wait until the core has run every bucket's decode step once (compiling each,
        recording its CUDA graph); seconds it took. Raises what the warm-up raised."""
        answer = self.link.ready(86400.0 if timeout is None else timeout)
        if answer is None:
            raise TimeoutError("the generation engine is still warming up")
        if isinstance(answer, WarmUpFailed):
            raise (UserError if answer.user_error else RuntimeError)(answer.message)
        self.ready_info = answer
        return answer.warmup_s

    def stop(self) -> None:
        self.link.stop()

    def submit(self, prompt: list[int], params: SamplingParams, adapter: int = 0
               ) -> Generation:
        """Queue a request (under the LoRA adapter of id ``adapter``, 0: none); raises
        WaitingFull past ``max_queue`` waiting, CoreDied once the core is gone. Call on the
        event loop."""
        if self.death is not None:
            raise CoreDied(self.death)
        if self.waiting >= self.max_queue:
            raise WaitingFull
        generation = Generation(next(self._ids), prompt, params, asyncio.get_running_loop(),
                                self.tokenizer.detokenizer(prompt), self._drop)
        with self._lock:
            self._live[generation.id] = generation
        self._submitted += 1
        self._pending_new.append(NewRequest(generation.id, list(prompt), params, adapter))
        self._flush_soon(generation.loop)
        return generation

    def _drop(self, generation: Generation) -> None:
        """Tell the core to drop a request (its client left, or a stop string ended it)."""
        self._pending_drops.append(generation.id)
        self._flush_soon(generation.loop)

    def _flush_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Send the core what this turn of the event loop queued, as one message."""
        self._flush_scheduled = False
        if (self._pending_new or self._pending_drops or self._pending_adapters
                or self._pending_unregistered):
            vocabulary = None
            if not self._vocabulary_sent and any(new.params.constraint is not None
                                                 for new in self._pending_new):
                vocabulary, self._vocabulary_sent = self.grammars.vocabulary, True
            inbox = Inbox(tuple(self._pending_new), tuple(self._pending_drops), vocabulary,
                          tuple(self._pending_adapters), tuple(self._pending_unregistered))
            self._pending_new, self._pending_drops = [], []
            self._pending_adapters, self._pending_unregistered = [], []
            self.link.send(inbox)

    # --- reports, from the core's thread or the link's reader ----------------------------

    def _on_report(self, report: Report) -> None:
        """Observe the step, and hand its outputs to their requests' event loops, one
        call into each (there is one: the server's)."""
        self._taken, self.occupancy = report.taken, report.occupancy
        observer = self.observer
        if observer is not None:
            try:
                for timing in report.timings:
                    observer.step(timing)
                observer.occupancy(report.occupancy)
            except Exception:
                log.exception("gpuflow serve: the generation engine's observer failed")
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Generation, Output | int]]] = {}
        live = self._live
        outputs = itertools.chain(((o.id, o) for o in report.outputs),
                                  zip(report.token_ids, report.tokens, strict=True))
        with self._lock:
            for request_id, output in outputs:
                generation = live.get(request_id)
                if generation is not None:
                    by_loop.setdefault(generation.loop, []).append((generation, output))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the event loop has closed
                loop.call_soon_threadsafe(self._deliver, items)

    def _deliver(self, items: list[tuple[Generation, Output | int]]) -> None:
        """On the event loop: each output's (or lone token's) events into its request's
        queue."""
        observer = self.observer
        for generation, output in items:
            if generation.finished:
                continue  # ended by a stop string; the core drops it at its next step
            events, drop = (generation.receive_token(output, observer)
                            if isinstance(output, int) else generation.receive(output, observer))
            for event in events:
                generation.events.put_nowait(event)
            if generation.finished:
                self._forget(generation)
                if drop:
                    self._drop(generation)

    def _forget(self, generation: Generation) -> None:
        with self._lock:
            self._live.pop(generation.id, None)

    def _on_exit(self, message: str) -> None:
        """The core is gone: every open request fails, and the server is told."""
        self.death = message
        log.error("gpuflow serve: %s; open requests fail", message)
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for generation in live:
            generation.finished = True
            with contextlib.suppress(RuntimeError):
                generation.loop.call_soon_threadsafe(_put, generation, Failed(message))
        if self.on_death is not None:
            self.on_death(message)


def _put(generation: Generation, event: Event) -> None:
    generation.events.put_nowait(event)
