"""The HTTP API: POST /v1/predict, GET /healthz, /readyz and /metrics (FastAPI, OpenAPI at
/docs), for language models the OpenAI-compatible POST /v1/completions,
POST /v1/chat/completions and GET /v1/models, and for speech recognisers
POST /v1/audio/transcriptions.

This module only assembles the server: the state (``state.py``: the engines, their
loading, warm-up and readiness), the routes (``routes/``, one module per API area), the
error envelope (``errors.py``: every error answers ``{"error": {"message", "type",
"param", "code"}}``) and the gate in front (``gate.py``: token, body size, the predict
fast path).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from fastapi import FastAPI

from gpuflow.serve import errors
from gpuflow.serve.engine import Engine
from gpuflow.serve.gate import Gate
from gpuflow.serve.routes import (
    adapters,
    chat,
    completions,
    health,
    models,
    predict,
    transcriptions,
)
from gpuflow.serve.routes.tool_parsers import PARSERS
from gpuflow.serve.settings import SETTINGS_ENV, ServeSettings, settings_from_json, settings_json
from gpuflow.serve.state import ServerState

__all__ = ["SETTINGS_ENV", "ServeSettings", "app_from_env", "create_app", "settings_json"]
ROUTERS = (health.router, predict.router, models.router, completions.router, chat.router,
           transcriptions.router, adapters.router)


def create_app(settings: ServeSettings, load: Callable[[], Engine] | None = None) -> FastAPI:
    """The server's app; ``load`` builds the engine (default: from ``settings.source``).
    Settings the command line would refuse are refused here too, before any request."""
    if settings.tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser {settings.tool_call_parser!r} is not one of "
                         f"{', '.join(PARSERS)}")
    state = ServerState(settings, load)
    app = FastAPI(title="gpuflow", summary="Predictions from a gpuflow model, batched.",
                  lifespan=state.lifespan)
    app.state.serve = state
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(Gate, state=state)
    return app


def app_from_env() -> FastAPI:
    """uvicorn's factory in each worker process: settings come from the environment."""
    return create_app(settings_from_json(os.environ[SETTINGS_ENV]))
