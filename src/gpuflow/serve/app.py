"""The HTTP API: POST /v1/predict, GET /healthz, /readyz and /metrics (FastAPI, OpenAPI at /docs),
and for language models the OpenAI-compatible POST /v1/completions and GET /v1/models.

The model loads and warms up in the background after start-up, so /healthz answers at once
and /readyz turns 200 only when every bucket has run (and compiled), the generation
engine's decode buckets included. A model that cannot be loaded or warmed up stops the
server (``ServeSettings.failure_file`` says why): /readyz answers 503 only while it is
still loading or warming up. Errors are JSON
``{"error": {"code": ..., "message": ...}}`` with a status that says what happened: 503
``queue_full`` with ``Retry-After`` when the bounded queue is full, 504 when a request's
deadline passes in the queue, 500 for the requests of a batch that raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hmac
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import STARTUP_FAILURE

from gpuflow.errors import UserError
from gpuflow.serve.batcher import (
    INLINE_BELOW_MS,
    Batcher,
    BatchFailed,
    DeadlineExceeded,
    QueueFull,
)
from gpuflow.serve.completions import RequestProblem, add_completion_routes
from gpuflow.serve.engine import Engine, EngineOptions
from gpuflow.serve.generate.engine import GenerationEngine, build_generator
from gpuflow.serve.generate.models import refusal
from gpuflow.serve.metrics import ServeMetrics
from gpuflow.serving import InputError, PredictRequest

SETTINGS_ENV = "GPUFLOW_SERVE_SETTINGS"
PREDICT_PATH = "/v1/predict"
CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; only seen in /metrics
# A body this small is decoded on the event loop: a hand-off to a thread and back costs
# more than decoding it (an 8x8 scan: ~20 us); larger ones (images, audio) go to a thread.
INLINE_DECODE_BYTES = 16 << 10
log = logging.getLogger("gpuflow.serve")


@dataclass(frozen=True)
class ServeSettings:
    """Everything a server process needs; JSON-able, so uvicorn workers can read it from env."""

    source: str
    workload: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    inline_below_ms: float = INLINE_BELOW_MS
    max_queue: int = 1024
    timeout_ms: float = 2000.0
    max_body_bytes: int = 8 << 20
    device: str = "auto"
    precision: str = "fp32"
    compile: bool = False
    cuda_graphs: bool = False
    token: str | None = None
    threads: int | None = None
    retry_after_s: int = 1
    kv_cache_gib: float | None = None
    workers: int = 1
    failure_file: str | None = None

    def engine_options(self) -> EngineOptions:
        return EngineOptions(self.device, self.precision, self.compile, self.cuda_graphs,
                             self.max_batch_size)


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


def error(status: int, code: str, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status,
                        headers=headers or None)


def unexpected(exc: Exception) -> JSONResponse:
    """The 500 answer to an error no handler answered; the traceback goes to the log."""
    log.error("gpuflow serve: unexpected error", exc_info=exc)
    return error(500, "internal", f"{type(exc).__name__}: {exc}")


Handler = Callable[[Request], Awaitable[Response]]


class _Gate:
    """Outermost ASGI layer: bearer-token check, early 413 on Content-Length, and the
    request count, in-flight gauge and latency of /v1/predict (401 and 413 included).

    ``POST /v1/predict`` goes from here straight to its handler: the router and the
    per-route wrappers behind this layer took ~0.15 ms of a small model's ~1.5 ms request
    in a profile, about the margin at one client against an endpoint that runs the model
    itself. Its route stays registered, for the API docs and for other methods (405)."""

    def __init__(self, app: ASGIApp, settings: ServeSettings, metrics: ServeMetrics,
                 predict: Handler) -> None:
        self.app, self.settings, self.metrics, self.predict = app, settings, metrics, predict
        self.expected = f"Bearer {settings.token}".encode() if settings.token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] != PREDICT_PATH:
            await self._checked(scope, receive, send)
            return
        status = CLIENT_CLOSED
        start = time.perf_counter()

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self._checked(scope, receive, record)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(str(status)).inc()
            self.metrics.latency.observe(time.perf_counter() - start)

    async def _checked(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        if self.expected is not None and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.expected):
            response: Response = error(401, "unauthorized",
                                       "Send the header 'Authorization: Bearer <token>'.",
                                       **{"WWW-Authenticate": "Bearer"})
        elif int(headers.get(b"content-length", b"0") or 0) > self.settings.max_body_bytes:
            response = _too_large(self.settings.max_body_bytes)
        elif scope["path"] == PREDICT_PATH and scope["method"] == "POST":
            try:
                response = await self.predict(Request(scope, receive))
            except Exception as exc:
                response = unexpected(exc)
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


def _queue_full(settings: ServeSettings) -> JSONResponse:
    return error(503, "queue_full", f"The queue is full ({settings.max_queue} requests "
                 "waiting); retry after the Retry-After seconds.",
                 **{"Retry-After": str(settings.retry_after_s)})


def _too_large(limit: int) -> JSONResponse:
    return error(413, "body_too_large", f"The request body is over the {limit} bytes this "
                                        "server takes (--max-body-bytes).")


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None once it passes ``limit`` (chunked bodies have no Content-Length)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _State:
    """The engine once loaded, whether it is warmed up, and the batcher feeding it."""

    def __init__(self) -> None:
        self.batcher: Batcher | None = None
        self.engine: Engine | None = None
        self.generator: GenerationEngine | None = None
        self.ready = asyncio.Event()
        self.problem: str | None = None
        self.warmup_s: float | None = None


def create_app(settings: ServeSettings, load: Callable[[], Engine] | None = None) -> FastAPI:
    """The server's app; ``load`` builds the engine (default: from ``settings.source``)."""
    load = load or (lambda: Engine.load(settings.source, settings.engine_options(),
                                        settings.workload))
    metrics = ServeMetrics(settings.max_batch_size)
    state = _State()

    def run_batch(key: Any, rows: list[Any]) -> list[Any]:
        assert state.engine is not None
        return state.engine.run(key, rows)

    batcher = Batcher(run_batch, settings.max_batch_size, settings.max_wait_ms / 1000,
                      settings.max_queue, metrics, settings.inline_below_ms / 1000)
    state.batcher = batcher

    async def prepare() -> None:
        loop = asyncio.get_running_loop()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        try:
            state.engine = await loop.run_in_executor(batcher.executor, load)
            state.warmup_s = await loop.run_in_executor(batcher.executor,
                                                        state.engine.warm_up)
            # What start-up made (torch, the model, the app: ~10^6 objects) is left out of
            # every later garbage collection: a full one over it stalled all requests for
            # ~100 ms every few thousand.
            gc.collect()
            gc.freeze()
            engine = state.engine
            state.generator = build_generator(
                engine.loaded.model, engine.runner, settings.kv_cache_gib,
                settings.max_batch_size, settings.max_queue, metrics)
            if state.generator is not None:  # its thread runs every decode bucket first
                state.generator.start()
                await asyncio.to_thread(state.generator.wait_warm)
        except Exception as exc:
            state.problem = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, UserError):
                log.error("gpuflow serve: the model cannot be served: %s", exc)
            else:
                log.exception("gpuflow serve: the model failed to load or warm up")
            if settings.failure_file:
                _stop_serving(settings, str(exc) if isinstance(exc, UserError)
                              else state.problem, isinstance(exc, UserError))
            return
        generation = ("" if state.generator is None else
                      f"; {state.generator.describe()}, {state.generator.warmup_s:.1f} s")
        log.info("gpuflow serve: ready after %.1f s of warm-up (%s%s)", state.warmup_s,
                 state.engine.runner.describe(), generation)
        state.ready.set()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        preparing = asyncio.create_task(prepare())
        yield
        preparing.cancel()
        await batcher.stop()
        if state.generator is not None:
            await asyncio.to_thread(state.generator.stop)

    app = FastAPI(title="gpuflow", summary="Predictions from a gpuflow model, batched.",
                  lifespan=lifespan)
    app.state.serve = state

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return unexpected(exc)

    @app.get("/healthz", summary="The process is alive")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz", summary="200 once the model is loaded and every bucket warmed up")
    async def readyz() -> JSONResponse:
        if state.ready.is_set() and state.engine is not None:
            generator = state.generator
            return JSONResponse({"ready": True, "warmup_s": state.warmup_s,
                                 **state.engine.describe(),
                                 "generation": None if generator is None else {
                                     "slots": generator.slots,
                                     "kv_cache_bytes": generator.cache.nbytes(),
                                     "decode": generator.describe(),
                                     "warmup_s": generator.warmup_s}})
        return JSONResponse({"ready": False, "state": state.problem or
                             ("warming up" if state.engine else "loading")}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post(PREDICT_PATH, summary="Predict labels and probabilities for one request",
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": PredictRequest.model_json_schema()}}}})
    async def predict(request: Request) -> Response:
        if not state.ready.is_set() or state.engine is None:
            return error(503, "not_ready", "The model is loading or warming up; see /readyz.",
                         **{"Retry-After": str(settings.retry_after_s)})
        engine = state.engine
        if batcher.full:  # refused before its body is read
            return _queue_full(settings)
        with batcher.incoming():
            body = await _read_body(request, settings.max_body_bytes)
            if body is None:
                return _too_large(settings.max_body_bytes)
            try:
                parsed = PredictRequest.model_validate_json(body)
                decoded = (engine.codec.decode(parsed) if len(body) <= INLINE_DECODE_BYTES
                           else await asyncio.to_thread(engine.codec.decode, parsed))
            except ValidationError as exc:
                return JSONResponse({"error": {
                    "code": "invalid_request",
                    "message": "The body does not match the request schema (see /docs).",
                    "details": json.loads(exc.json(include_url=False))}}, status_code=422)
            except InputError as exc:
                return error(422, "invalid_input", str(exc))
            if len(decoded.rows) > settings.max_batch_size:
                return error(422, "too_many_inputs", f"{len(decoded.rows)} inputs in one "
                             f"request; this server takes at most {settings.max_batch_size} "
                             "(--max-batch-size).")
            timeout_ms = min(parsed.timeout_ms or settings.timeout_ms, settings.timeout_ms)
            try:
                submitted = batcher.submit(decoded.key, decoded.rows, timeout_ms / 1000)
            except QueueFull:
                return _queue_full(settings)
        await asyncio.sleep(0)  # one turn of the loop: a lone request run inline is done
        if not submitted.done():  # watch the client while its request waits
            gone = asyncio.ensure_future(_disconnected(request))
            await asyncio.wait({submitted, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
        if not submitted.done():  # the client went away: drop its request
            submitted.cancel()
            await asyncio.gather(submitted, return_exceptions=True)
            return Response(status_code=CLIENT_CLOSED)
        try:
            result = submitted.result()
        except DeadlineExceeded:
            return error(504, "deadline_exceeded", f"The request waited {timeout_ms:g} ms in "
                         "the queue without reaching the model; it was dropped.")
        except BatchFailed as exc:
            log.error("gpuflow serve: a batch failed: %s", exc)
            return error(500, "batch_failed", f"The batch this request ran in failed ({exc}); "
                         "the server keeps serving.")
        metrics.queue_time.observe(result.queue_s)
        metrics.compute_time.observe(result.compute_s)
        return JSONResponse({
            "predictions": [engine.codec.format(out, parsed) for out in result.outputs],
            "queue_ms": round(result.queue_s * 1000, 3),
            "compute_ms": round(result.compute_s * 1000, 3),
            "batch_rows": result.batch_rows,
            "model": {"workload": engine.loaded.workload.name, "step": engine.loaded.step},
        })

    def generator() -> GenerationEngine:
        if not state.ready.is_set() or state.engine is None:
            raise RequestProblem(503, "not_ready",
                                 "The model is loading or warming up; see /readyz.")
        if state.generator is None:
            raise RequestProblem(404, "not_a_language_model", f"This server's model "
                                 f"({state.engine.loaded.workload.name}) does not generate "
                                 f"text ({refusal(state.engine.loaded.model)}); use "
                                 "/v1/predict.")
        return state.generator

    def model_name() -> str:
        return state.engine.loaded.workload.name if state.engine else "loading"

    add_completion_routes(app, generator, model_name, settings.timeout_ms / 1000,
                          _disconnected, CLIENT_CLOSED)
    app.add_middleware(_Gate, settings=settings, metrics=metrics, predict=predict)
    return app


def app_from_env() -> FastAPI:
    """uvicorn's factory in each worker process: settings come from the environment."""
    return create_app(ServeSettings(**json.loads(os.environ[SETTINGS_ENV])))


def settings_json(settings: ServeSettings) -> str:
    return json.dumps(dataclasses.asdict(settings))
