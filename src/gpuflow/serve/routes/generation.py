"""What every OpenAI-compatible generation route shares (``/v1/completions``, chat, ...):
the body validated into a pydantic model, the ``model`` and prompt checked, the prompt
handed to the generation engine, and the answer written whole or streamed.

A route begins with ``accept`` (the engine, the body parsed by ``parse_body``, its
``model`` checked by ``check_model``), checks its prompt with ``check_prompt``, and
returns ``await generate(request, prompt, params, answer, stream)`` with an ``Answer``
that writes its own JSON (``text_completion``, ``chat.completion``, ...).
``generate`` handles the rest the same way for all: 503 ``queue_full`` when the engine's
waiting queue is full (``--max-queue``), 504 when the first token has not come within
``--ttft-timeout-ms`` (no deadline by default: a request waits for KV blocks as long as its
client does), a client that goes away, before its first token or after, leaving the
engine at the next step (its queue place or KV blocks freed; status 499), server-sent
events ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any, Protocol, TypeVar

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gpuflow.serve.errors import ApiError, invalid_body
from gpuflow.serve.generate.engine import CoreDied, GenerationEngine
from gpuflow.serve.generate.requests import Delta, Done, Event, Failed, Generation, WaitingFull
from gpuflow.serve.generate.sampling import SamplingParams
from gpuflow.serve.routes.client import CLIENT_CLOSED, finished_unless_gone, read_body
from gpuflow.serve.state import ServerState

Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class Target:
    """What a request's ``model`` names: the name its answer gives, and the LoRA adapter
    it runs under (``AdapterRef.id``; 0: the base model alone)."""

    name: str
    adapter: int = 0


async def accept(request: Request, model: type[Body]
                 ) -> tuple[ServerState, GenerationEngine, Body, Target]:
    """How every generation route begins: the engine (503 while loading, 404 for a model
    that does not generate text), then the body as ``model`` (``parse_body``), its
    ``model`` field naming the served model or one of its adapters (``check_model``)."""
    state = ServerState.of(request)
    engine = state.ready_generator()
    body = await parse_body(request, model)
    target = check_model(request, getattr(body, "model", None))
    return state, engine, body, target


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The body as ``model``; 400 naming the field at fault (OpenAI answers 400 where
    FastAPI would say 422), 413 past ``--max-body-bytes``."""
    raw = await read_body(request, ServerState.of(request).settings.max_body_bytes)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_body(exc, model) from None


def check_model(request: Request, requested: str | None) -> Target:
    """The served model or adapter ``requested`` names (none: the served model); 404
    ``model_not_found`` for any other name."""
    state = ServerState.of(request)
    if requested is None or state.serves(requested):
        return Target(state.model_name)
    adapters = None if state.generator is None else state.generator.adapters
    ref = None if adapters is None else adapters.get(requested)
    if ref is None:
        served = [state.model_name, *(r.name for r in adapters or ())]
        raise ApiError(404, f"The model {requested!r} does not exist here: this server "
                       f"serves {', '.join(map(repr, served))} (GET /v1/models).",
                       "model_not_found", "model")
    return Target(requested, ref.id)


def check_prompt(tokens: list[int], max_tokens: int, engine: GenerationEngine,
                 param: str = "prompt", max_tokens_param: str = "max_tokens") -> None:
    """400 for a prompt the model cannot take: empty, ids outside the vocabulary, or with
    ``max_tokens`` longer than the context (naming the prompt if it alone fills it)."""
    if not tokens:
        raise ApiError(400, f"{param} is empty: give at least one token.", "invalid_prompt",
                       param)
    if min(tokens) < 0 or max(tokens) >= engine.vocab_size:
        raise ApiError(400, f"{param}: token ids must lie in [0, {engine.vocab_size - 1}].",
                       "invalid_prompt", param)
    if len(tokens) + max_tokens > engine.context:
        raise ApiError(400, f"{param} ({len(tokens)} tokens) + {max_tokens_param} "
                       f"({max_tokens}) is more than this model's context of {engine.context} "
                       f"tokens; shorten the {param} or lower {max_tokens_param}.",
                       "context_length_exceeded",
                       param if len(tokens) >= engine.context else max_tokens_param)


@dataclass(eq=False)
class Choice:
    """One choice of an answer: its place among the answer's choices, the prompt it
    continues (an index into the request's prompts), its generation, the text deltas so
    far and its finish."""

    index: int
    prompt_index: int
    generation: Generation
    deltas: list[Delta] = field(default_factory=list)
    done: Done | None = None

    @property
    def text(self) -> str:
        return "".join(delta.text for delta in self.deltas)


class Answer(Protocol):
    """How a route writes its answer from its choices' events."""

    def whole(self, choices: list[Choice]) -> dict[str, Any]:
        """The body of the answer when it is not streamed, every choice finished."""

    def chunks(self, choice: Choice, event: Delta | Done) -> list[dict[str, Any]]:
        """The stream's chunks for one event of one choice."""

    def text_chunk(self, choice: Choice, delta: Delta) -> bytes | None:
        """The server-sent event of a plain text delta, rendered from the choice's template
        (``Reply.templated``); None where the delta needs ``chunks`` (log-probabilities,
        a choice's first chunk)."""

    def last(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """The stream's chunks once every choice has finished (e.g. the usage)."""


TEXT_MARK = "\x00text\x00"  # where a template's text goes; no model writes NUL into JSON
# Answer ids: random for this server process, then counted. A uuid4 an answer read the OS's
# random source at every request (tens of microseconds in a VM, 2% of the server's time at
# 500 requests a second); these stay unique across requests and restarts alike.
_SERVER_ID = uuid.uuid4().hex[:16]
_ANSWERS = itertools.count()


class Reply:
    """What every OpenAI answer carries: an id, the time, the model; a base for Answers."""

    def __init__(self, model: str, id_prefix: str) -> None:
        self.model, self.id = model, f"{id_prefix}-{_SERVER_ID}{next(_ANSWERS):016x}"
        self.created = int(time.time())
        self.templates: dict[int, tuple[bytes, bytes]] = {}

    def templated(self, index: int, chunk: Callable[[str], dict[str, Any]], text: str
                  ) -> bytes:
        """``sse(chunk(text))``, from the bytes of choice ``index``'s chunk rendered once
        around its text: a streamed token then costs one string's JSON, not a payload's
        (the chunks of a stream differ in their text alone)."""
        parts = self.templates.get(index)
        if parts is None:
            head, _, tail = sse(chunk(TEXT_MARK)).partition(json.dumps(TEXT_MARK).encode())
            parts = self.templates[index] = (head, tail)
        # json.dumps(text) less its Python-level dispatch: the same C function it calls.
        return parts[0] + encode_basestring_ascii(text).encode() + parts[1]

    def payload(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def usage(choices: list[Choice]) -> dict[str, Any]:
    """Token counts: each prompt once, however many choices continue it, and every
    choice's completion; of the prompts' tokens, those found in the prefix cache (the
    fewest any choice of a prompt found)."""
    prompts = {c.prompt_index: len(c.generation.prompt) for c in choices}
    cached: dict[int, int] = {}
    for c in choices:
        found = c.done.cached_tokens if c.done is not None else 0
        cached[c.prompt_index] = min(cached.get(c.prompt_index, found), found)
    prompt = sum(prompts.values())
    completion = sum(c.done.completion_tokens for c in choices if c.done is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


async def generate(request: Request, prompts: list[list[int]], params: list[SamplingParams],
                   answer: Answer, stream: bool, adapter: int = 0) -> Response:
    """Generate one choice for each prompt and each of ``params`` (the choices of one
    prompt, e.g. ``n`` of them with their own seeds), numbered prompt by prompt, under the
    LoRA adapter ``adapter`` (0: none), and answer: whole, or as server-sent events."""
    state = ServerState.of(request)
    choices = _submit(state, [(i, prompt, p) for i, prompt in enumerate(prompts)
                              for p in params], adapter)
    deadline_ms = state.settings.ttft_timeout_ms
    firsts = asyncio.ensure_future(
        _first_events(choices, None if deadline_ms is None else deadline_ms / 1000))
    if not await _unless_gone(request, firsts, choices):  # no deadline: watch the client
        return Response(status_code=CLIENT_CLOSED)
    if stream:
        return StreamingResponse(_stream(choices, firsts.result(), answer),
                                 media_type="text/event-stream")
    collected = asyncio.ensure_future(_collect(choices, firsts.result(), answer))
    if not await _unless_gone(request, collected, choices):
        return Response(status_code=CLIENT_CLOSED)
    return collected.result()


async def _unless_gone(request: Request, work: asyncio.Future[Any],
                       choices: list[Choice]) -> bool:
    """Whether ``work`` finished before the client left; if the client left, its choices
    leave the engine at its next step (their queue places or blocks freed)."""
    if await finished_unless_gone(request, work):
        return True
    _cancel(choices)
    work.cancel()
    return False


def _submit(state: ServerState, jobs: list[tuple[int, list[int], SamplingParams]],
            adapter: int) -> list[Choice]:
    """The one place requests enter the generation engine: every choice, or none."""
    engine = state.ready_generator()
    choices: list[Choice] = []
    try:
        for prompt_index, prompt, params in jobs:
            choices.append(Choice(len(choices), prompt_index,
                                  engine.submit(prompt, params, adapter)))
    except WaitingFull:
        _cancel(choices)
        raise ApiError(503, f"{engine.max_queue} requests wait to start already (--max-queue); "
                       "retry later.", "queue_full", headers=state.retry_after()) from None
    except CoreDied as exc:
        _cancel(choices)
        raise ApiError(503, f"The generation engine is down ({exc}); the server is stopping.",
                       "engine_down") from None
    return choices


def _cancel(choices: list[Choice]) -> None:
    for choice in choices:  # a no-op for one finished; frees the blocks of one running
        choice.generation.cancel()


async def _first_events(choices: list[Choice], timeout_s: float | None) -> list[Event]:
    """Every choice's first event, within the deadline if there is one (504 otherwise)."""
    try:
        return await asyncio.wait_for(
            asyncio.gather(*(c.generation.events.get() for c in choices)), timeout_s)
    except TimeoutError:
        _cancel(choices)
        assert timeout_s is not None
        raise ApiError(504, f"No token within {timeout_s * 1000:g} ms (--ttft-timeout-ms); "
                       "the request was dropped.", "deadline_exceeded") from None


def _failed(event: Failed) -> ApiError:
    return ApiError(500, f"Generation failed ({event.message}).",
                    "generation_failed")


def _final(event: Event) -> bool:
    return isinstance(event, Done | Failed)


async def _batches(choices: list[Choice], firsts: list[Event]
                   ) -> AsyncIterator[list[tuple[Choice, Event]]]:
    """The choices' events in order, until every choice has finished, each time all that
    are queued: a stream that fell behind the engine catches up in one write. One choice
    is read from its own queue; several through one queue their events are copied into."""
    if len(choices) == 1:
        [choice], queue = choices, choices[0].generation.events
        batch = [firsts[0]]
        while True:
            while not _final(batch[-1]) and not queue.empty():
                batch.append(queue.get_nowait())
            yield [(choice, event) for event in batch]
            if _final(batch[-1]):
                return
            batch = [await queue.get()]
    merged: asyncio.Queue[tuple[Choice, Event]] = asyncio.Queue()
    for choice, first in zip(choices, firsts, strict=True):
        merged.put_nowait((choice, first))
    copies = [asyncio.create_task(_copy(choice, merged))
              for choice, first in zip(choices, firsts, strict=True) if not _final(first)]
    running = len(choices)
    try:
        while running:
            items = [await merged.get()]
            while not merged.empty():
                items.append(merged.get_nowait())
            running -= sum(_final(event) for _, event in items)
            yield items
    finally:
        for copy in copies:
            copy.cancel()


async def _copy(choice: Choice, merged: asyncio.Queue[tuple[Choice, Event]]) -> None:
    while True:
        event = await choice.generation.events.get()
        merged.put_nowait((choice, event))
        if _final(event):
            return


async def _collect(choices: list[Choice], firsts: list[Event], answer: Answer) -> Response:
    async for items in _batches(choices, firsts):
        for choice, event in items:
            if isinstance(event, Failed):
                _cancel(choices)
                raise _failed(event)
            _record(choice, event)
    return JSONResponse(answer.whole(choices))


def _record(choice: Choice, event: Delta | Done) -> None:
    if isinstance(event, Delta):
        choice.deltas.append(event)
    else:
        choice.done = event


async def _stream(choices: list[Choice], firsts: list[Event],
                  answer: Answer) -> AsyncIterator[bytes]:
    try:
        async for items in _batches(choices, firsts):
            parts = []
            for choice, event in items:
                if isinstance(event, Failed):
                    parts.append(sse(_failed(event).body()))
                    continue
                _record(choice, event)
                quick = answer.text_chunk(choice, event) if isinstance(event, Delta) else None
                if quick is not None:
                    parts.append(quick)
                else:
                    parts += map(sse, answer.chunks(choice, event))
            yield b"".join(parts)
        yield b"".join(map(sse, answer.last(choices))) + b"data: [DONE]\n\n"
    finally:
        _cancel(choices)  # frees the blocks if the client left


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
