"""OpenAI-compatible text completions: ``POST /v1/completions`` (answered whole, or streamed
as server-sent events with ``stream: true``) and ``GET /v1/models``.

Requests go to the generation engine (``gpuflow.serve.generate``). A request waits for a
free cache slot in a bounded queue (503 ``queue_full`` when it is full); if its first token
has not come within the server's ``--timeout-ms`` it is dropped (504); a client that goes
away frees its slot at the next decode step. The answer carries ``usage`` token counts.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuflow.serve.generate.engine import Delta, Done, Event, Failed, Generation, WaitingFull
from gpuflow.serve.generate.sampling import SamplingParams

MAX_STOP = 4


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` (OpenAI's fields; ``top_k`` as vLLM adds it)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 keeps every token")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    n: int = Field(1, ge=1, le=1, description="one completion per request")
    user: str | None = None

    def sampling(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k,
                              self.seed, tuple(stop))


class RequestProblem(Exception):
    """A request the server answers with an error status and envelope."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "type": code}},
                        status_code=status)


def _prompt_tokens(body: CompletionRequest, lm: Any) -> list[int]:
    tokens = lm.tokenize(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    if not tokens:
        raise RequestProblem(400, "invalid_prompt", "prompt is empty: give at least one token.")
    if min(tokens) < 0 or max(tokens) >= lm.vocab_size:
        raise RequestProblem(400, "invalid_prompt",
                             f"prompt: token ids must lie in [0, {lm.vocab_size - 1}].")
    if len(tokens) + body.max_tokens > lm.context:
        raise RequestProblem(400, "context_length_exceeded",
                             f"prompt ({len(tokens)} tokens) + max_tokens ({body.max_tokens}) "
                             f"is more than this model's context of {lm.context} tokens; "
                             "shorten the prompt or lower max_tokens.")
    if len(body.stop or []) > MAX_STOP:
        raise RequestProblem(400, "invalid_stop", f"stop: at most {MAX_STOP} strings.")
    return tokens


async def _first_event(generation: Generation, timeout_s: float) -> Event:
    try:
        return await asyncio.wait_for(generation.events.get(), timeout_s)
    except TimeoutError:
        generation.cancel()
        raise RequestProblem(504, "deadline_exceeded",
                             f"No token within {timeout_s * 1000:g} ms (--timeout-ms); the "
                             "request was dropped.") from None


def add_completion_routes(app: FastAPI, get_engine: Callable[[], Any],
                          model_name: Callable[[], str], timeout_s: float,
                          watch_disconnect: Callable[[Request], Any],
                          client_closed: int) -> None:
    """Register the OpenAI-compatible routes; ``get_engine`` raises RequestProblem while
    there is no engine to generate with."""

    @app.get("/v1/models", summary="The model this server serves (OpenAI-compatible)")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name(), "object": "model", "created": int(time.time()),
             "owned_by": "gpuflow"}]})

    @app.post("/v1/completions", summary="Complete a prompt (OpenAI-compatible)",
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": CompletionRequest.model_json_schema()}}}})
    async def completions(request: Request) -> Response:
        try:
            engine = get_engine()
            try:
                body = CompletionRequest.model_validate_json(await request.body())
            except ValidationError as exc:
                return JSONResponse({"error": {
                    "code": "invalid_request", "type": "invalid_request",
                    "message": "The body does not match the request schema (see /docs).",
                    "details": json.loads(exc.json(include_url=False))}}, status_code=422)
            if body.model is not None and body.model != model_name():
                raise RequestProblem(404, "model_not_found", f"This server serves "
                                     f"{model_name()!r}, not {body.model!r}.")
            prompt = _prompt_tokens(body, engine.lm)
            try:
                generation = engine.submit(prompt, body.sampling())
            except WaitingFull:
                raise RequestProblem(503, "queue_full", f"{engine.max_waiting} requests wait "
                                     "for a slot already; retry later.") from None
            first = await _first_event(generation, timeout_s)
        except RequestProblem as problem:
            return _error(problem.status, problem.code, str(problem))
        answer = _Answer(model_name(), generation, body)
        if body.stream:
            return StreamingResponse(answer.stream(first), media_type="text/event-stream")
        collected = asyncio.ensure_future(answer.collect(first))
        gone = asyncio.ensure_future(watch_disconnect(request))
        await asyncio.wait({collected, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not collected.done():  # the client went away: free its slot
            generation.cancel()
            collected.cancel()
            return Response(status_code=client_closed)
        return collected.result()


class _Answer:
    """One completion's events as an OpenAI response or a stream of chunks."""

    def __init__(self, model: str, generation: Generation, body: CompletionRequest) -> None:
        self.model, self.generation, self.body = model, generation, body
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, **extra}

    @staticmethod
    def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}

    @staticmethod
    def _usage(done: Done) -> dict[str, int]:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens}

    async def _batches(self, first: Event) -> AsyncIterator[list[Event]]:
        """The events in order, ending with the finish, each time all that are queued: a
        stream that fell behind the engine catches up in one write."""
        queue = self.generation.events
        batch = [first]
        while True:
            while not isinstance(batch[-1], Done | Failed) and not queue.empty():
                batch.append(queue.get_nowait())
            yield batch
            if isinstance(batch[-1], Done | Failed):
                return
            batch = [await queue.get()]

    async def collect(self, first: Event) -> Response:
        parts = []
        async for batch in self._batches(first):
            for event in batch:
                if isinstance(event, Failed):
                    return _error(500, "generation_failed", f"Generation failed "
                                  f"({event.message}); the server keeps serving.")
                if isinstance(event, Delta):
                    parts.append(event.text)
        assert isinstance(event, Done)
        return JSONResponse(self._envelope([self._choice("".join(parts), event.finish_reason)],
                                           usage=self._usage(event)))

    async def stream(self, first: Event) -> AsyncIterator[bytes]:
        try:
            async for batch in self._batches(first):
                yield b"".join(self._chunks(event) for event in batch)
            yield b"data: [DONE]\n\n"
        finally:
            self.generation.cancel()  # a no-op once finished; frees the slot if the client left

    def _chunks(self, event: Event) -> bytes:
        """One event's server-sent events: a text chunk, the finish (and the usage chunk
        when ``stream_options.include_usage`` asks for it) or the error."""
        if isinstance(event, Delta):
            return _sse(self._envelope([self._choice(event.text, None)]))
        if isinstance(event, Failed):
            return _sse({"error": {"code": "generation_failed", "message": event.message}})
        chunks = _sse(self._envelope([self._choice("", event.finish_reason)]))
        if (self.body.stream_options or {}).get("include_usage"):
            chunks += _sse(self._envelope([], usage=self._usage(event)))
        return chunks


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
