"""Every error the server answers, in OpenAI's envelope:
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.

One shape for every route and status, so that a client (the openai SDK, LangChain, a load
test) reads any refusal the same way: ``type`` is OpenAI's class of error, derived from
the status; ``code`` says what happened (``queue_full``, ``context_length_exceeded``, ...);
``param`` names the request field at fault. Handlers raise ``ApiError``; the exception
handlers installed by ``install`` turn it, Starlette's 404 and 405, a request body that
does not validate and any unexpected exception (500, traceback logged) into responses; a
client that hangs up before its body arrived gets an INFO line (``closed_early``).
"""

from __future__ import annotations

import logging
import types
import typing
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

log = logging.getLogger("gpuflow.serve")

# OpenAI's error types by status; a status not listed takes its class's (4xx, 5xx).
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error",
         413: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error"}
CODES = {404: "not_found", 405: "method_not_allowed"}
CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; only seen in /metrics


def error_type(status: int) -> str:
    return TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class ApiError(Exception):
    """A request answered with an error status; ``extra`` adds fields to the envelope
    (e.g. ``/v1/predict``'s validation ``details``)."""

    def __init__(self, status: int, message: str, code: str | None, param: str | None = None,
                 headers: Mapping[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers, self.extra = dict(headers or {}), extra

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.code, **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def unexpected(exc: Exception) -> JSONResponse:
    """The 500 answer to an error no handler answered; the traceback goes to the log."""
    log.error("gpuflow serve: unexpected error", exc_info=exc)
    return ApiError(500, f"{type(exc).__name__}: {exc}", "internal").response()


def closed_early() -> Response:
    """The answer, read by no one, to a client that hung up before its whole body arrived
    (Starlette's ``ClientDisconnect``): clients do that, and nothing here went wrong, so one
    INFO line rather than an error with tracebacks."""
    log.info("gpuflow serve: client closed the connection before its body arrived")
    return Response(status_code=CLIENT_CLOSED)


def invalid_body(exc: ValidationError, model: type[BaseModel], status: int = 400,
                 **extra: Any) -> ApiError:
    """A body that ``model`` refused, named by its most precise field: of a union's
    alternatives the error that got furthest into the value, its dotted path as ``param``
    (``messages.0.role``), each alternative's complaint in the message."""
    errors = exc.errors(include_url=False)
    if not errors:
        return ApiError(status, "The body does not match the request schema (see /docs).",
                        "invalid_request", **extra)
    named = [(field_path(model, error["loc"]), error) for error in errors]
    param = max((path for path, _ in named), key=lambda p: p.count(".") + bool(p))
    if any(error["type"] == "extra_forbidden" for path, error in named if path == param):
        message = f"Unrecognized request argument supplied: {param}"
    else:
        said = dict.fromkeys(error["msg"] for path, error in named if path == param)
        message = f"{param or 'body'}: {' or '.join(said)}"
    return ApiError(status, message, "invalid_request", param or None, **extra)


def field_path(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """``loc`` as the client spelled the field, without the tags pydantic inserts after a
    union field to say which alternative it tried (``('prompt', 'list[int]', 1)`` is
    ``prompt.1``)."""
    kept: list[str] = []
    shapes: list[Any] = [model]
    tag_next = False
    for part in loc:
        if tag_next:
            tag_next = False
            continue
        kept.append(str(part))
        inner = [_inner(shape, part) for shape in shapes]
        shapes = list(dict.fromkeys(alt for alts, _ in inner for alt in alts))
        tag_next = len(shapes) > 1 or any(tagged for _, tagged in inner)
    return ".".join(kept)


Shapes = tuple[list[Any], bool]


def _inner(shape: Any, part: int | str) -> Shapes:
    """What ``part`` of a value of type ``shape`` may be (a field's type, a list's item),
    and whether pydantic tags it as a discriminated union, whatever its alternatives."""
    if isinstance(shape, type) and issubclass(shape, BaseModel):
        fields = {f.alias or name: f for name, f in shape.model_fields.items()}
        found = fields.get(str(part))
        if found is None:
            return [], False
        alts, tagged = _alternatives(found.annotation)
        return alts, tagged or found.discriminator is not None
    args = typing.get_args(shape)
    origin = typing.get_origin(shape)
    if origin in (list, tuple, set, frozenset) and isinstance(part, int) and args:
        return _alternatives(args[0])
    if origin is dict and len(args) == 2:
        return _alternatives(args[1])
    return [], False


def _alternatives(annotation: Any) -> Shapes:
    """The types a value of ``annotation`` may take (``None`` and ``Annotated`` left
    out), and whether a discriminator makes them a tagged union."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *metadata = typing.get_args(annotation)
        alts, tagged = _alternatives(inner)
        return alts, tagged or any(getattr(m, "discriminator", None) for m in metadata)
    if origin in (typing.Union, types.UnionType):
        found = [_alternatives(arg) for arg in typing.get_args(annotation)]
        return ([alt for alts, _ in found for alt in alts],
                any(tagged for _, tagged in found))
    return ([] if annotation is type(None) else [annotation]), False


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors: no such route (404), a method the route does not take (405,
    its ``Allow`` header kept)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"No route {request.method} {request.url.path}; see /docs."
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"{request.url.path} does not take {request.method} (only {allowed})."
    else:
        message = exc.detail
    return ApiError(exc.status_code, message, CODES.get(exc.status_code),
                    headers=exc.headers).response()


async def _route_validation(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's check of a route's declared parameters (the routes here read their bodies
    themselves, so this is a fallback)."""
    assert isinstance(exc, RequestValidationError)
    [first, *_] = [*exc.errors(), {"loc": (), "msg": "invalid request"}]
    param = ".".join(str(part) for part in first["loc"][1:]) or None
    return ApiError(400, f"{param or 'request'}: {first['msg']}", "invalid_request",
                    param).response()


async def _closed_early(request: Request, exc: Exception) -> Response:
    return closed_early()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    return unexpected(exc)


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` in the envelope."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _route_validation)
    app.add_exception_handler(ClientDisconnect, _closed_early)
    app.add_exception_handler(Exception, _unexpected)
