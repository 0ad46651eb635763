"""One server's state: the engines it serves with, whether they are ready, and their
lifetime (load, warm-up, readiness, stop).

The model loads and warms up in the background after start-up, so /healthz answers at
once and /readyz turns 200 only when every bucket has run (and compiled), the generation
engine's decode buckets included. A model that cannot be loaded or warmed up stops the
server (``ServeSettings.failure_file`` says why): /readyz answers 503 only while it is
still loading or warming up. Route handlers reach the state with ``ServerState.of``
and the engines through accessors that raise the error a request gets meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from starlette.requests import HTTPConnection
from uvicorn.config import STARTUP_FAILURE

from gpuflow.byte_vocab import END_OF_DOCUMENT
from gpuflow.errors import UserError
from gpuflow.model_dir import GenerationDefaults
from gpuflow.serve.batcher import Batcher
from gpuflow.serve.engine import Engine
from gpuflow.serve.errors import ApiError
from gpuflow.serve.generate.adapter_files import AdapterRegistry, BaseLayout
from gpuflow.serve.generate.build import build_generator
from gpuflow.serve.generate.engine import GenerationEngine
from gpuflow.serve.generate.models import adapter_refusal, refusal
from gpuflow.serve.generate.tokenizer import HFTokenizer, load_tokenizer
from gpuflow.serve.metrics import ServeMetrics
from gpuflow.serve.model import load_model
from gpuflow.serve.settings import ServeSettings

log = logging.getLogger("gpuflow.serve")


class ServerState:
    """The predict ``Engine`` and its ``Batcher``, the ``GenerationEngine`` of a language
    model (None otherwise), the metrics, and ``ready`` once both engines are warm."""

    def __init__(self, settings: ServeSettings,
                 load: Callable[[], Engine] | None = None) -> None:
        self.settings = settings
        names = settings.served_model_name
        self._load = load or (lambda: Engine.load(
            settings.source, settings.engine_options(), settings.workload,
            names[0] if names else None, settings.max_model_len))
        self.metrics = ServeMetrics(settings.max_batch_size)
        self.batcher = Batcher(self._run_batch, settings.max_batch_size,
                               settings.max_wait_ms / 1000, settings.max_queue, self.metrics,
                               settings.inline_below_ms / 1000)
        self.engine: Engine | None = None
        self.generator: GenerationEngine | None = None
        self.ready = asyncio.Event()
        self.problem: str | None = None
        self.warmup_s: float | None = None
        self.chat_template: str | None = None  # --chat-template's, read once
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs

    @staticmethod
    def of(connection: HTTPConnection) -> ServerState:
        """The state of the app serving ``connection`` (a Request)."""
        state = connection.app.state.serve
        assert isinstance(state, ServerState)
        return state

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """The app's lifespan: loading starts with the server; stopping ends both engines."""
        self._loop = asyncio.get_running_loop()
        self.batcher.start()
        preparing = asyncio.create_task(self._prepare())
        yield
        preparing.cancel()
        await self.batcher.stop()
        if self.generator is not None:
            await asyncio.to_thread(self.generator.stop)

    def _run_batch(self, key: Any, rows: list[Any]) -> list[Any]:
        assert self.engine is not None
        return self.engine.run(key, rows)

    @property
    def model_name(self) -> str:
        """The name clients call the model by (``/v1/models``, the ``model`` field)."""
        names = self.settings.served_model_name
        if names:
            return names[0]
        return self.engine.loaded.workload.name if self.engine else "loading"

    def serves(self, name: str) -> bool:
        """Whether ``name`` is one of the names the model is served under."""
        return name in (self.settings.served_model_name or (self.model_name,))

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The sampling a request gets where it sets none (the model's generation config)."""
        directory = self.engine.loaded.directory if self.engine else None
        return directory.generation if directory else GenerationDefaults()

    def retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.settings.retry_after_s)}

    def ready_engine(self) -> Engine:
        """The predict engine; 503 ``not_ready`` until both engines are warm."""
        if not self.ready.is_set() or self.engine is None:
            raise ApiError(503, "The model is loading or warming up; see /readyz.",
                           "not_ready", headers=self.retry_after())
        return self.engine

    def ready_generator(self) -> GenerationEngine:
        """The generation engine; 503 while loading, 404 for a model that does not
        generate text, saying why."""
        engine = self.ready_engine()
        if self.generator is None:
            raise ApiError(404, f"This server's model ({engine.loaded.workload.name}) does "
                           f"not generate text ({refusal(engine.loaded.model)}); use "
                           "/v1/predict.", "not_a_language_model")
        return self.generator

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """What /readyz says: what runs and how long warming up took, or the stage."""
        if not self.ready.is_set() or self.engine is None:
            return False, {"ready": False, "state": self.problem or
                           ("warming up" if self.engine else "loading")}
        generator = self.generator
        return True, {"ready": True, "warmup_s": self.warmup_s, **self.engine.describe(),
                      "generation": None if generator is None else {
                          **generator.limits(), "decode": generator.describe(),
                          "warmup_s": generator.warmup_s}}

    async def _prepare(self) -> None:
        """Load and warm up both engines, then turn ready; on failure, say why and stop."""
        settings = self.settings
        if settings.threads:
            torch.set_num_threads(settings.threads)
        try:
            if settings.chat_template:
                self.chat_template = _read_template(Path(settings.chat_template))
            await self._load_and_warm_up()
        except Exception as exc:
            self.problem = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, UserError):
                log.error("gpuflow serve: the model cannot be served: %s", exc)
            else:
                log.exception("gpuflow serve: the model failed to load or warm up")
            if settings.failure_file:
                _stop_serving(settings, str(exc) if isinstance(exc, UserError)
                              else self.problem, isinstance(exc, UserError))
            return
        assert self.engine is not None
        generation = ("" if self.generator is None else
                      f"; {self.generator.describe()}, {self.generator.warmup_s:.1f} s, the "
                      f"engine core in {self.generator.link.where}")
        log.info("gpuflow serve: ready after %.1f s of warm-up (%s%s)", self.warmup_s,
                 self.engine.runner.describe(), generation)
        self.ready.set()

    async def _load_and_warm_up(self) -> None:
        loop = asyncio.get_running_loop()
        executor = self.batcher.executor
        self.engine = engine = await loop.run_in_executor(executor, self._load)
        self.warmup_s = await loop.run_in_executor(executor, engine.warm_up)
        # What start-up made (torch, the model, the app: ~10^6 objects) is left out of
        # every later garbage collection: a full one over it stalled all requests for
        # ~100 ms every few thousand.
        gc.collect()
        gc.freeze()
        self.generator = generator = self._build_generator(engine)
        if generator is not None:  # its core runs every decode bucket first
            generator.on_death = self._core_died
            generator.start()
            await asyncio.to_thread(generator.wait_warm)

    def _core_died(self, message: str) -> None:
        """The generation engine's core process is gone (from its reader thread): /readyz
        turns 503 and the server stops, failing, rather than stay up unable to generate."""
        self.problem = f"the generation engine failed: {message}"
        loop, ready = self._loop, self.ready
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop has closed
                loop.call_soon_threadsafe(ready.clear)
        if self.settings.failure_file:
            _stop_serving(self.settings, self.problem, False)

    def _build_generator(self, engine: Engine) -> GenerationEngine | None:
        """The one place the generation engine is made from the loaded model
        (``_generator``), serving ``--lora``'s adapters (checked first)."""
        adapters = self._adapters(engine)
        generator = self._generator(engine)
        if generator is not None and adapters is not None:
            generator.serve_adapters(adapters)
        return generator

    def _adapters(self, engine: Engine) -> AdapterRegistry | None:
        """``--lora``'s adapters, each checked against the loaded model, or None when no
        adapters are served (``--max-loras`` 0)."""
        settings, loaded = self.settings, engine.loaded
        if not settings.max_loras:
            return None
        why = adapter_refusal(loaded.model)
        if why is not None:
            raise UserError(f"--lora and --max-loras cannot serve adapters here: {why}.")
        directory = None if loaded.directory is None else str(loaded.directory.path)
        registry = AdapterRegistry(BaseLayout.of(loaded.model, directory),
                                   settings.max_lora_rank,
                                   frozenset(settings.served_model_name or (self.model_name,)))
        for name, path in settings.lora:
            registry.add(name, path)
        return registry

    def _generator(self, engine: Engine) -> GenerationEngine | None:
        """The generation engine of the loaded model: with the tokenizer, end-of-sequence
        ids and context of its directory when it has one (a directory's model that cannot
        generate is refused: generating is what it is served for), with bytes for a model
        gpuflow trained on them, ending at the end-of-document byte its packs put between
        documents."""
        settings, loaded = self.settings, engine.loaded
        directory = loaded.directory
        draft = self._draft_model(engine)
        if directory is None:
            return build_generator(loaded.model, engine.runner, settings.engine_limits(),
                                   self.metrics, eos_ids=(END_OF_DOCUMENT,),
                                   draft_model=draft, decode_graphs=settings.decode_graphs,
                                   max_autotune=settings.max_autotune,
                                   engine_process=settings.engine_process,
                                   threads=settings.threads,
                                   kv_cache_dtype=settings.kv_cache_dtype)
        tokenizer = load_tokenizer(directory.path)
        why = refusal(loaded.model, tokenized=True)
        if why is not None:
            raise UserError(f"{directory.path} cannot be served: the generation engine "
                            f"cannot drive it ({why}).")
        return build_generator(
            loaded.model, engine.runner, settings.engine_limits(), self.metrics, tokenizer,
            directory.generation.eos_ids or _eos_of(tokenizer),
            directory.context_length(settings.max_model_len), draft, settings.decode_graphs,
            settings.max_autotune, settings.engine_process, settings.threads,
            settings.kv_cache_dtype)

    def _draft_model(self, engine: Engine) -> torch.nn.Module | None:
        """``--draft-model`` on the served model's device, with the same tokenizer (ids that
        mean other text would draft nothing useful), or None."""
        settings = self.settings
        if settings.draft_model is None or not settings.num_speculative_tokens:
            return None
        draft = load_model(settings.draft_model)
        served = engine.loaded.directory
        if (draft.directory is None) != (served is None) or (
                served is not None and draft.directory is not None
                and load_tokenizer(draft.directory.path).hf.get_vocab()
                != load_tokenizer(served.path).hf.get_vocab()):
            raise UserError(f"--draft-model {settings.draft_model} does not share the served "
                            "model's tokenizer: a draft model's token ids must mean the same "
                            "text.")
        return draft.model.to(engine.runner.device, engine.runner.dtype).eval()


def _eos_of(tokenizer: HFTokenizer) -> tuple[int, ...]:
    """The tokenizer's own end-of-sequence id, for a directory whose configs name none."""
    found = tokenizer.hf.eos_token_id
    return () if found is None else (int(found),)


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--chat-template {path} cannot be read ({exc}).") from None


def _stop_serving(settings: ServeSettings, reason: str, user_error: bool) -> None:
    """Say why in ``failure_file`` and stop: a server that can never become ready must not
    stay up. One worker asks its own server to shut down as Ctrl-C does (uvicorn re-raises
    the signal after shutting down, and uvicorn.run returns on that one); a worker among
    several exits as one that failed to start, which stops uvicorn's supervisor instead of
    a restart."""
    assert settings.failure_file is not None
    Path(settings.failure_file).write_text(json.dumps({"reason": reason,
                                                       "user_error": user_error}))
    if settings.workers > 1:
        os._exit(STARTUP_FAILURE)
    signal.raise_signal(signal.SIGINT)
