"""``POST /v1/predict``: named inputs decoded by the workload's codec, run in the dynamic
batcher, answered with the codec's predictions and the request's queue and compute times.

The gate (``gpuflow.serve.gate``) calls ``predict`` directly, ahead of FastAPI's router:
the route stays registered for the API docs and for other methods (405).
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.requests import Request

from gpuflow.serve.batcher import BatchFailed, DeadlineExceeded, QueueFull, Result
from gpuflow.serve.errors import ApiError, invalid_body
from gpuflow.serve.routes.client import (
    CLIENT_CLOSED,
    body_schema,
    finished_unless_gone,
    read_body,
)
from gpuflow.serve.routes.uploads import image_upload
from gpuflow.serve.state import ServerState
from gpuflow.serving import Decoded, InputError, PredictRequest

PREDICT_PATH = "/v1/predict"
# A body this small is decoded on the event loop: a hand-off to a thread and back costs
# more than decoding it (an 8x8 scan: ~20 us); larger ones (images, audio) go to a thread.
INLINE_DECODE_BYTES = 16 << 10
log = logging.getLogger("gpuflow.serve")
router = APIRouter()


def queue_full(state: ServerState) -> ApiError:
    return ApiError(503, f"The queue is full ({state.settings.max_queue} requests waiting); "
                    "retry after the Retry-After seconds.", "queue_full",
                    headers=state.retry_after())


@router.post(PREDICT_PATH, summary="Predict labels and probabilities for one request",
             openapi_extra=body_schema(PredictRequest))
async def predict(request: Request) -> Response:
    state = ServerState.of(request)
    engine = state.ready_engine()
    batcher, settings = state.batcher, state.settings
    if batcher.full:  # refused before its body is read
        raise queue_full(state)
    with batcher.incoming():
        parsed, decoded = await _decode(request, state)
        timeout_ms = min(parsed.timeout_ms or settings.timeout_ms, settings.timeout_ms)
        submitted = submit(state, decoded, timeout_ms)
    result = await outcome(request, state, submitted, timeout_ms)
    if isinstance(result, Response):
        return result
    return JSONResponse({
        "predictions": [engine.codec.format(out, parsed) for out in result.outputs],
        "queue_ms": round(result.queue_s * 1000, 3),
        "compute_ms": round(result.compute_s * 1000, 3),
        "batch_rows": result.batch_rows,
        "model": {"workload": engine.loaded.workload.name, "step": engine.loaded.step},
    })


def submit(state: ServerState, decoded: Decoded, timeout_ms: float) -> asyncio.Future[Result]:
    """Queue a request's rows (inside ``batcher.incoming()``); 503 when the queue is full."""
    try:
        return state.batcher.submit(decoded.key, decoded.rows, timeout_ms / 1000)
    except QueueFull:
        raise queue_full(state) from None


async def outcome(request: Request, state: ServerState, submitted: asyncio.Future[Result],
                  timeout_ms: float) -> Result | Response:
    """The rows' outputs with their times (observed in the metrics), or the empty answer
    to a client that left; 504 past the deadline, 500 when the batch failed."""
    await asyncio.sleep(0)  # one turn of the loop: a lone request run inline is done
    if not await finished_unless_gone(request, submitted):  # the client left: drop it
        submitted.cancel()
        await asyncio.gather(submitted, return_exceptions=True)
        return Response(status_code=CLIENT_CLOSED)
    try:
        result = submitted.result()
    except DeadlineExceeded:
        raise ApiError(504, f"The request waited {timeout_ms:g} ms in the queue without "
                       "reaching the model; it was dropped.", "deadline_exceeded") from None
    except BatchFailed as exc:
        log.error("gpuflow serve: a batch failed: %s", exc)
        raise ApiError(500, f"The batch this request ran in failed ({exc}); the server keeps "
                       "serving.", "batch_failed") from None
    state.metrics.queue_time.observe(result.queue_s)
    state.metrics.compute_time.observe(result.compute_s)
    return result


async def _decode(request: Request, state: ServerState) -> tuple[PredictRequest, Decoded]:
    """The body (JSON, or an image upload) parsed and decoded into model rows; 422 when it
    does not fit the schema or the model, or holds more rows than a batch."""
    codec, limit = state.ready_engine().codec, state.settings.max_batch_size
    body = await read_body(request, state.settings.max_body_bytes)
    try:
        parsed = (image_upload(request.headers.get("content-type"), body, request.query_params)
                  or PredictRequest.model_validate_json(body))
        decoded = (codec.decode(parsed) if len(body) <= INLINE_DECODE_BYTES
                   else await asyncio.to_thread(codec.decode, parsed))
    except ValidationError as exc:
        raise invalid_body(exc, PredictRequest, 422, details=json.loads(
            exc.json(include_url=False))) from None
    except InputError as exc:
        raise ApiError(422, str(exc), "invalid_input") from None
    if len(decoded.rows) > limit:
        raise ApiError(422, f"{len(decoded.rows)} inputs in one request; this server takes "
                       f"at most {limit} (--max-batch-size).", "too_many_inputs")
    return parsed, decoded
