"""LoRA adapters added and dropped while the server runs: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, under the names and bodies vLLM gives them (behind the
token when one is set, as every route). An adapter added is checked against the base before
any request can name it; one dropped answers no new request, and the requests it runs
already finish."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from gpuflow.errors import UserError
from gpuflow.serve.errors import ApiError
from gpuflow.serve.generate.adapter_files import AdapterRegistry
from gpuflow.serve.routes.generation import parse_body
from gpuflow.serve.state import ServerState

router = APIRouter()


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # accepted, as vLLM's clients send it; the name decides


def _registry(state: ServerState) -> AdapterRegistry:
    """The served adapters; 400 where the server serves none, or runs several workers (each
    with its own engine: one request would reach one of them)."""
    registry = state.ready_generator().adapters
    if registry is None:
        raise ApiError(400, "This server serves no LoRA adapters: start it with --lora "
                       "NAME=DIR or --max-loras N.", "adapters_not_served")
    if state.settings.workers > 1:
        raise ApiError(400, f"This server runs {state.settings.workers} workers, each with "
                       "engines of its own: give its adapters at start-up (--lora).",
                       "adapters_not_served")
    return registry


@router.post("/v1/load_lora_adapter", summary="Serve a LoRA adapter under a name",
             response_class=PlainTextResponse)
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = ServerState.of(request)
    registry = _registry(state)
    body = await parse_body(request, LoadAdapter)
    name = body.lora_name
    if state.serves(name) or name in registry:
        raise ApiError(400, f"The name {name!r} is taken: unload that adapter first, or give "
                       "this one another name.", "invalid_value", "lora_name")
    try:
        state.ready_generator().register_adapter(name, body.lora_path)
    except UserError as exc:
        raise ApiError(400, str(exc), "invalid_value", "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", summary="Stop serving a LoRA adapter",
             response_class=PlainTextResponse)
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = ServerState.of(request)
    registry = _registry(state)
    body = await parse_body(request, UnloadAdapter)
    if body.lora_name not in registry:
        raise ApiError(404, f"No LoRA adapter is served as {body.lora_name!r}.",
                       "model_not_found", "lora_name")
    state.ready_generator().unregister_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                             "successfully.")
