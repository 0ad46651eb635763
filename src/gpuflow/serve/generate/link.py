"""Where the engine core runs, and how the server reaches it: a thread of the server's own
(``ThreadLink``: tests, and a core that cannot leave the process) or a process of its own
(``ProcessLink``: what ``gpuflow serve`` runs).

Either way the core runs one loop (``run_core``): warm up, say ``Ready``, then take every
``Inbox`` the server sent since the last step, step, and publish the step's ``Report``,
sleeping only while no request is live. In a process of its own, the core's host work
(scheduling, block tables, sampling, launches) no longer shares an interpreter with the
HTTP server, tokenizing, detokenizing and SSE framing: each gets a core of the CPU and a
GIL of its own. Messages cross a pipe (``multiprocessing``), one each way a step; the
model's weights cross once, as shared memory (CPU) or CUDA IPC handles
(``torch.multiprocessing``), not as copies. The core process dies with the server (its
pipe closes) and the server learns of the core's death from its own end of the pipe.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch.multiprocessing

from gpuflow.errors import UserError
from gpuflow.serve.generate.core import EngineCore
from gpuflow.serve.generate.messages import Inbox, Ready, Report, WarmUpFailed

log = logging.getLogger("gpuflow.serve")
Context = Callable[[], contextlib.AbstractContextManager[Any]]
OnReport = Callable[[Report], None]
OnExit = Callable[[str], None]


class CoreSpec(Protocol):
    """What a core process is started from: picklable, built in the child."""

    def build(self) -> tuple[EngineCore, Context]: ...


def run_core(core: EngineCore, context: Context, take: Callable[[bool], list[Inbox] | None],
             publish: Callable[[Report | Ready | WarmUpFailed], None]) -> None:
    """The core's loop, until ``take`` (waiting for a message when ``core.idle``) returns
    None: the server stopped, or went away."""
    with context():
        try:
            core.start(context)
        except BaseException as exc:
            log.exception("gpuflow serve: the decode warm-up failed")
            publish(WarmUpFailed(f"{type(exc).__name__}: {exc}", isinstance(exc, UserError)))
            core.stop()
            return
        assert core.runner.warmup_s is not None
        publish(Ready(core.runner.describe(), core.limits(), core.runner.warmup_s))
        try:
            while (inboxes := take(core.idle)) is not None:
                try:
                    for inbox in inboxes:
                        core.receive(inbox)
                    report = core.step()
                except Exception as exc:  # the core's own bookkeeping, not a step's forward
                    log.exception("gpuflow serve: the engine core failed a step")
                    report = core.fail_all(f"{type(exc).__name__}: {exc}")
                if report is not None:
                    publish(report)
        finally:
            core.stop()


class ThreadLink:
    """The core in a thread of the server's process."""

    where = "a thread of the server"

    def __init__(self, core: EngineCore, context: Context) -> None:
        self.core, self._context = core, context
        self._inbox: list[Inbox] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._ready: Ready | WarmUpFailed | None = None
        self._warm = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_report: OnReport, on_exit: OnExit) -> None:
        def publish(message: Report | Ready | WarmUpFailed) -> None:
            if isinstance(message, Report):
                on_report(message)
            else:
                self._ready = message
                self._warm.set()

        self._thread = threading.Thread(
            target=run_core, args=(self.core, self._context, self._take, publish),
            name="gpuflow-generate", daemon=True)
        self._thread.start()

    def _take(self, wait: bool) -> list[Inbox] | None:
        if wait:
            self._wake.wait(0.5)
        self._wake.clear()
        with self._lock:
            inboxes, self._inbox = self._inbox, []
        return None if self._stopped else inboxes

    def send(self, inbox: Inbox) -> None:
        with self._lock:
            self._inbox.append(inbox)
        self._wake.set()

    def ready(self, timeout: float) -> Ready | WarmUpFailed | None:
        """The core's word after its warm-up, or None if none came within ``timeout``."""
        self._warm.wait(timeout)
        return self._ready

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


class ProcessLink:
    """The core in a process of its own, started (spawned) from ``spec``."""

    where = "a process of its own"

    def __init__(self, spec: CoreSpec) -> None:
        self._spec = spec
        self._fallback: ThreadLink | None = None  # where the spec does not pickle
        context = torch.multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_core_process, args=(spec, child),
                                        name="gpuflow-engine-core", daemon=True)
        self._child = child
        self._send_lock = threading.Lock()
        self._ready: Ready | WarmUpFailed | None = None
        self._warm = threading.Event()
        self._stopping = False
        self._reader: threading.Thread | None = None

    @property
    def core(self) -> EngineCore | None:
        """The core, when it fell back to a thread of this process."""
        return None if self._fallback is None else self._fallback.core

    def start(self, on_report: OnReport, on_exit: OnExit) -> None:
        """Start the process (the spec, weights and all, crosses here) and the thread that
        reads its reports; a spec that does not pickle (weights of a tensor subclass that
        cannot cross, e.g. torchao's int8) runs its core in a thread here instead."""
        try:
            self._process.start()
        except Exception as exc:
            log.warning("gpuflow serve: the engine core runs in a thread of the server: its "
                        "model cannot cross to a process of its own (%s: %s)",
                        type(exc).__name__, exc)
            self._child.close()
            self._fallback = ThreadLink(*self._spec.build())
            self.where = self._fallback.where
            self._fallback.start(on_report, on_exit)
            return
        self._child.close()
        self._reader = threading.Thread(target=self._read, args=(on_report, on_exit),
                                        name="gpuflow-engine-reader", daemon=True)
        self._reader.start()

    def _read(self, on_report: OnReport, on_exit: OnExit) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Report):
                on_report(message)
            else:
                self._ready = message
                self._warm.set()
        self._process.join(timeout=5)
        if not self._stopping:
            code = self._process.exitcode
            on_exit(f"the engine core process (pid {self._process.pid}) exited "
                    + ("unexpectedly" if code is None else f"with code {code}"))
        self._warm.set()

    def send(self, inbox: Inbox) -> None:
        if self._fallback is not None:
            return self._fallback.send(inbox)
        with self._send_lock, contextlib.suppress(OSError):  # gone: the reader says so
            self._conn.send(inbox)

    def ready(self, timeout: float) -> Ready | WarmUpFailed | None:
        if self._fallback is not None:
            return self._fallback.ready(timeout)
        self._warm.wait(timeout)
        if self._ready is None and self._warm.is_set():
            return WarmUpFailed("the engine core process exited while warming up "
                                f"(code {self._process.exitcode}); see the log above")
        return self._ready

    def stop(self) -> None:
        if self._fallback is not None:
            return self._fallback.stop()
        self._stopping = True
        with self._send_lock, contextlib.suppress(OSError):
            self._conn.send(None)
        # A core still warming up reads no pipe until it is warm (a compile can take
        # minutes) and holds nothing to finish: it is not waited for.
        self._process.join(timeout=30 if self._warm.is_set() else 1)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()


def _core_process(spec: CoreSpec, conn: Connection) -> None:
    """The core process: build, warm up, then step until the server says stop or goes."""
    # Ctrl-C, or a stop sent to the whole process group, is the server's to handle: it
    # stops the core through the pipe, and the core leaves when the pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    try:
        core, context = spec.build()
    except BaseException as exc:
        if not isinstance(exc, UserError):
            log.exception("gpuflow serve: the engine core could not be built")
        conn.send(WarmUpFailed(f"{type(exc).__name__}: {exc}" if not isinstance(exc, UserError)
                               else str(exc), isinstance(exc, UserError)))
        return

    def take(wait: bool) -> list[Inbox] | None:
        inboxes = []
        try:
            if wait:
                conn.poll(None)
            while conn.poll(0):
                message = conn.recv()
                if message is None:
                    return None
                inboxes.append(message)
        except (EOFError, OSError):  # the server went away
            return None
        return inboxes

    run_core(core, context, take, conn.send)
