"""What every OpenAI-compatible generation route shares (``/v1/completions``, chat, ...):
the body validated into a pydantic model, the ``model`` and prompt checked, the prompt
handed to the generation engine, and the answer written whole or streamed.

A route begins with ``accept`` (the engine, the body parsed by ``parse_body``, its
``model`` checked by ``check_model``), checks its prompt with ``check_prompt``, and
returns ``await generate(request, prompt, params, answer, stream)`` with an ``Answer``
that writes its own JSON (``text_completion``, ``chat.completion``, ...).
``generate`` handles the rest the same way for all: 503 ``queue_full`` when the engine's
waiting queue is full, 504 when the first token has not come within ``--timeout-ms``, a
client that goes away freeing its slot (status 499), server-sent events ending with
``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeVar

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gpuflow.serve.errors import ApiError, invalid_body
from gpuflow.serve.generate.engine import (
    Delta,
    Done,
    Event,
    Failed,
    Generation,
    GenerationEngine,
    WaitingFull,
)
from gpuflow.serve.generate.sampling import SamplingParams
from gpuflow.serve.routes.client import CLIENT_CLOSED, finished_unless_gone, read_body
from gpuflow.serve.state import ServerState

Body = TypeVar("Body", bound=BaseModel)


async def accept(request: Request, model: type[Body]
                 ) -> tuple[ServerState, GenerationEngine, Body]:
    """How every generation route begins: the engine (503 while loading, 404 for a model
    that does not generate text), then the body as ``model`` (``parse_body``), its
    ``model`` field naming the served model (``check_model``)."""
    state = ServerState.of(request)
    engine = state.ready_generator()
    body = await parse_body(request, model)
    check_model(request, getattr(body, "model", None))
    return state, engine, body


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The body as ``model``; 400 naming the field at fault (OpenAI answers 400 where
    FastAPI would say 422), 413 past ``--max-body-bytes``."""
    raw = await read_body(request, ServerState.of(request).settings.max_body_bytes)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_body(exc, model) from None


def check_model(request: Request, requested: str | None) -> None:
    """404 ``model_not_found`` unless ``requested`` is the served model (or not given)."""
    served = ServerState.of(request).model_name
    if requested is not None and requested != served:
        raise ApiError(404, f"The model {requested!r} does not exist here: this server "
                       f"serves {served!r}.", "model_not_found", "model")


def check_prompt(tokens: list[int], max_tokens: int, engine: GenerationEngine,
                 param: str = "prompt", max_tokens_param: str = "max_tokens") -> None:
    """400 for a prompt the model cannot take: empty, ids outside the vocabulary, or with
    ``max_tokens`` longer than the context (naming the prompt if it alone fills it)."""
    lm = engine.lm
    if not tokens:
        raise ApiError(400, f"{param} is empty: give at least one token.", "invalid_prompt",
                       param)
    if min(tokens) < 0 or max(tokens) >= lm.vocab_size:
        raise ApiError(400, f"{param}: token ids must lie in [0, {lm.vocab_size - 1}].",
                       "invalid_prompt", param)
    if len(tokens) + max_tokens > lm.context:
        raise ApiError(400, f"{param} ({len(tokens)} tokens) + {max_tokens_param} "
                       f"({max_tokens}) is more than this model's context of {lm.context} "
                       f"tokens; shorten the {param} or lower {max_tokens_param}.",
                       "context_length_exceeded",
                       param if len(tokens) >= lm.context else max_tokens_param)


class Answer(Protocol):
    """How a route writes its answer from the engine's events."""

    def whole(self, deltas: list[Delta], done: Done) -> dict[str, Any]:
        """The body of the answer when it is not streamed."""

    def chunks(self, event: Delta | Done) -> list[dict[str, Any]]:
        """The stream's chunks for one event (none, one, or e.g. a finish and a usage)."""


class Reply:
    """What every OpenAI answer carries: an id, the time, the model; a base for Answers."""

    def __init__(self, model: str, id_prefix: str) -> None:
        self.model, self.id = model, f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def payload(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def usage(done: Done) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


async def generate(request: Request, prompt: list[int], params: SamplingParams,
                   answer: Answer, stream: bool) -> Response:
    """Generate from ``prompt`` and answer: whole, or as server-sent events."""
    state = ServerState.of(request)
    generation = _submit(state, prompt, params)
    first = await _first_event(generation, state.settings.timeout_ms / 1000)
    if stream:
        return StreamingResponse(_stream(generation, first, answer),
                                 media_type="text/event-stream")
    collected = asyncio.ensure_future(_collect(generation, first, answer))
    if not await finished_unless_gone(request, collected):  # free the slot of a client gone
        generation.cancel()
        collected.cancel()
        return Response(status_code=CLIENT_CLOSED)
    return collected.result()


def _submit(state: ServerState, prompt: list[int], params: SamplingParams) -> Generation:
    """The one place a request enters the generation engine."""
    engine = state.ready_generator()
    try:
        return engine.submit(prompt, params)
    except WaitingFull:
        raise ApiError(503, f"{engine.max_waiting} requests wait for a slot already; retry "
                       "later.", "queue_full", headers=state.retry_after()) from None


async def _first_event(generation: Generation, timeout_s: float) -> Event:
    try:
        return await asyncio.wait_for(generation.events.get(), timeout_s)
    except TimeoutError:
        generation.cancel()
        raise ApiError(504, f"No token within {timeout_s * 1000:g} ms (--timeout-ms); the "
                       "request was dropped.", "deadline_exceeded") from None


def _failed(event: Failed) -> ApiError:
    return ApiError(500, f"Generation failed ({event.message}); the server keeps serving.",
                    "generation_failed")


async def _batches(generation: Generation, first: Event) -> AsyncIterator[list[Event]]:
    """The events in order, ending with the finish, each time all that are queued: a
    stream that fell behind the engine catches up in one write."""
    queue = generation.events
    batch = [first]
    while True:
        while not isinstance(batch[-1], Done | Failed) and not queue.empty():
            batch.append(queue.get_nowait())
        yield batch
        if isinstance(batch[-1], Done | Failed):
            return
        batch = [await queue.get()]


async def _collect(generation: Generation, first: Event, answer: Answer) -> Response:
    deltas: list[Delta] = []
    async for batch in _batches(generation, first):
        for event in batch:
            if isinstance(event, Failed):
                raise _failed(event)
            if isinstance(event, Delta):
                deltas.append(event)
    assert isinstance(event, Done)
    return JSONResponse(answer.whole(deltas, event))


async def _stream(generation: Generation, first: Event,
                  answer: Answer) -> AsyncIterator[bytes]:
    try:
        async for batch in _batches(generation, first):
            yield b"".join(sse(chunk) for event in batch for chunk in (
                [_failed(event).body()] if isinstance(event, Failed) else answer.chunks(event)))
        yield b"data: [DONE]\n\n"
    finally:
        generation.cancel()  # a no-op once finished; frees the slot if the client left


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
