"""``POST /v1/audio/transcriptions``: OpenAI's speech-to-text API over a model whose codec
transcribes audio (it reads audio bytes, ``codec.read``, into chunks whose transcripts
``codec.join`` puts together), batched by length with every other request.

The multipart form takes ``file`` (WAV, FLAC, Ogg or MP3), ``model``, ``language``,
``prompt``, ``temperature`` and ``timestamp_granularities[]`` (accepted; greedy CTC decoding
uses none of them) and ``response_format``: ``json`` (``{"text"}``), ``text`` (the
transcript alone) or ``verbose_json`` (duration, one segment and word timings from the
CTC alignment). Anything else is refused naming the field, and the server stays up.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import UploadFile
from starlette.requests import Request

from gpuflow.serve.errors import ApiError
from gpuflow.serve.routes.predict import outcome, submit
from gpuflow.serve.state import ServerState
from gpuflow.serving import InputError

PATH = "/v1/audio/transcriptions"
FORMATS = ("json", "text", "verbose_json")
IGNORED = {"model", "language", "prompt", "temperature", "timestamp_granularities[]",
           "timestamp_granularities"}
router = APIRouter()


@router.post(PATH, summary="Transcribe an audio file (OpenAI-compatible)")
async def transcribe(request: Request) -> Response:
    state = ServerState.of(request)
    codec = state.ready_engine().codec
    if not callable(getattr(codec, "read", None)) or not callable(getattr(codec, "join", None)):
        raise ApiError(400, "This model does not transcribe audio: its run's workload has "
                       "no transcription codec. Serve a run of the asr workload.",
                       "model_not_transcriber", "model")
    with state.batcher.incoming():
        data, name, response_format = await _form(request)
        try:
            decoded = await asyncio.to_thread(codec.read, data, name)
        except InputError as exc:
            raise ApiError(400, str(exc), "invalid_audio", "file") from None
        timeout_ms = state.settings.timeout_ms
        submitted = submit(state, decoded, timeout_ms)
    result = await outcome(request, state, submitted, timeout_ms)
    if isinstance(result, Response):
        return result
    output = codec.join(result.outputs)
    if response_format == "text":
        return PlainTextResponse(output["text"])
    if response_format == "json":
        return JSONResponse({"text": output["text"]})
    return JSONResponse(verbose(output))


async def _form(request: Request) -> tuple[bytes, str, str]:
    """The uploaded file's bytes and name, and the response format; 400 naming the field
    at fault."""
    try:
        form = await request.form()
    except Exception as exc:  # starlette's multipart parser raises its own types
        raise ApiError(400, f"The body is not a multipart form ({exc}); send the audio as "
                       "the form's `file` field.", "invalid_form") from None
    unknown = sorted(set(form.keys()) - IGNORED - {"file", "response_format"})
    if unknown:
        raise ApiError(400, f"Unknown form field {unknown[0]!r}; this route takes file, "
                       f"response_format and {', '.join(sorted(IGNORED))}.", "unknown_field",
                       unknown[0])
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "The form has no `file` upload; send the audio file as `file`.",
                       "missing_file", "file")
    response_format = str(form.get("response_format") or "json")
    if response_format not in FORMATS:
        raise ApiError(400, f"response_format {response_format!r} is not offered; use one of "
                       f"{', '.join(FORMATS)}.", "unsupported_format", "response_format")
    data = await upload.read()
    if not data:
        raise ApiError(400, "The uploaded file is empty.", "empty_file", "file")
    return data, upload.filename or "the uploaded file", response_format


def verbose(output: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``verbose_json``: one segment over the words the alignment placed."""
    words = output["words"]
    segment = {"id": 0, "seek": 0, "start": words[0]["start"] if words else 0.0,
               "end": words[-1]["end"] if words else 0.0, "text": output["text"],
               "tokens": [], "temperature": 0.0, "avg_logprob": 0.0,
               "compression_ratio": 0.0, "no_speech_prob": 0.0}
    return {"task": "transcribe", "language": "english", "duration": output["duration"],
            "text": output["text"], "segments": [segment] if words else [], "words": words}
