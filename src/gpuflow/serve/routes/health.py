"""``/healthz`` (the process is alive), ``/readyz`` (the model is loaded and warm) and
``/metrics`` (Prometheus): what an orchestrator and a dashboard poll."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request

from gpuflow.serve.state import ServerState

router = APIRouter()


@router.get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "alive"}


@router.get("/readyz", summary="200 once the model is loaded and every bucket warmed up")
async def readyz(request: Request) -> JSONResponse:
    ready, body = ServerState.of(request).readiness()
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", summary="Prometheus metrics")
async def prometheus(request: Request) -> Response:
    registry = ServerState.of(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
