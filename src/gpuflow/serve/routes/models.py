"""``GET /v1/models``: the one model this server serves, as OpenAI lists models."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.requests import Request

from gpuflow.serve.state import ServerState

router = APIRouter()


@router.get("/v1/models", summary="The model this server serves (OpenAI-compatible)")
async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [
        {"id": ServerState.of(request).model_name, "object": "model",
         "created": int(time.time()), "owned_by": "gpuflow"}]})
