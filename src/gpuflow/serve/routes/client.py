"""The client's side of a request: its body, read within a limit, and whether the client
is still there while its request waits."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request

from gpuflow.serve.errors import CLIENT_CLOSED as CLIENT_CLOSED  # the routes' name for it
from gpuflow.serve.errors import ApiError


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` that shows ``model`` as a route's request body in /docs: the
    handlers read their bodies themselves (for speed, and for errors in the envelope)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is over the {limit} bytes this server takes "
                    "(--max-body-bytes).", "body_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body; 413 once it passes ``limit``: the gate checks ``Content-Length``, but a
    chunked body has none. A client gone before its end raises ``ClientDisconnect``, which
    the app answers with ``errors.closed_early``."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def finished_unless_gone(request: Request, work: asyncio.Future[Any]) -> bool:
    """Wait for ``work`` or for the client to go away, whichever comes first; True if the
    work finished. The caller drops work whose client left (its slot or queue place)."""
    if not work.done():
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
    return work.done()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
