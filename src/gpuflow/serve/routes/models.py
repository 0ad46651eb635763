"""``GET /v1/models``: the one model this server serves, under each name it answers to
(``--served-model-name``), and each LoRA adapter served on it (its ``parent`` the model's
name, its ``root`` its directory), as OpenAI lists models."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.requests import Request

from gpuflow.serve.dtypes import short_name
from gpuflow.serve.state import ServerState

router = APIRouter()


@router.get("/v1/models", summary="The model this server serves (OpenAI-compatible)")
async def models(request: Request) -> JSONResponse:
    state = ServerState.of(request)
    names = state.settings.served_model_name or (state.model_name,)
    created = int(time.time())
    runs = {} if state.engine is None else {"dtype": short_name(state.engine.runner.dtype)}
    if state.generator is not None:
        runs |= {"max_model_len": state.generator.context,
                 "kv_cache_dtype": state.generator.limits().get("kv_cache_dtype")}
    adapters = None if state.generator is None else state.generator.adapters
    return JSONResponse({"object": "list", "data": [
        *({"id": name, "object": "model", "created": created, "owned_by": "gpuflow", **runs}
          for name in names),
        *({"id": ref.name, "object": "model", "created": created, "owned_by": "gpuflow",
           "parent": state.model_name, "root": ref.path, **runs} for ref in adapters or ())]})
