"""Structured outputs on both generation routes: OpenAI's ``response_format``
(``json_object``, ``json_schema``) and vLLM's ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar`` (Lark or GBNF), turned into the grammar the engine
constrains decoding with (``generate/grammar.py``). The grammar is compiled here, in the
server (cached), so that one the engine cannot compile is a 400 naming its parameter; in a
worker thread (llguidance drops the GIL), so that a long compile holds up no other
request."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gpuflow.serve.errors import ApiError
from gpuflow.serve.generate.engine import GenerationEngine
from gpuflow.serve.generate.grammar import Constraint, GrammarError
from gpuflow.serve.routes.sampling_fields import GenerationFields

GUIDED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def requested(body: GenerationFields) -> tuple[Constraint, str] | None:
    """The grammar the request asks for and the parameter that asks; None when it asks
    for none (or for ``response_format`` ``text``). 400 naming a malformed one."""
    asked = [name for name in GUIDED if getattr(body, name) is not None]
    if len(asked) > 1:
        raise ApiError(400, f"{asked[1]}: at most one of {', '.join(GUIDED)} per request.",
                       "invalid_value", asked[1])
    if not asked:
        return None
    name = asked[0]
    constraint, param = _constraint(name, getattr(body, name))
    return None if constraint is None else (constraint, param)


async def compiled(asked: tuple[Constraint, str] | None,
                   engine: GenerationEngine) -> Constraint | None:
    """The asked constraint once it compiles against the served vocabulary (cached), in a
    worker thread; 400 naming its parameter if it does not."""
    if asked is None:
        return None
    constraint, param = asked
    try:
        await asyncio.to_thread(lambda: engine.grammars.compile(constraint))
    except GrammarError as exc:
        raise ApiError(400, f"{param}: the grammar engine (llguidance) cannot compile it: "
                       f"{exc}", "invalid_grammar", param) from None
    return constraint


def _constraint(name: str, value: Any) -> tuple[Constraint | None, str]:
    """The constraint one field asks for, and the parameter to name when it is refused."""
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "guided_json":
            return Constraint.json_schema(_schema(value, name)), name
        if name == "guided_regex":
            return Constraint.regex(value), name
        if name == "guided_choice":
            if not value:
                raise ApiError(400, "guided_choice: at least one string.", "invalid_value", name)
            return Constraint.choice(value), name
        return Constraint.lark(value), name
    except GrammarError as exc:
        raise ApiError(400, f"{name}: {exc}", "invalid_grammar", name) from None


def _response_format(value: Any) -> tuple[Constraint | None, str]:
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (``{"name", "schema", "strict"}``; ``strict`` is always
    honoured: the grammar admits only what the schema does)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return Constraint.json_object(), "response_format"
    if kind == "json_schema":
        spec = value.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise ApiError(400, f"{param}: an object with a name and a schema.",
                           "invalid_value", param)
        param += ".schema"
        return Constraint.json_schema(_schema(spec.get("schema", {"type": "object"}),
                                              param)), param
    raise ApiError(400, f"response_format.type: {kind!r} is not one of 'text', 'json_object', "
                   "'json_schema'.", "invalid_value", "response_format.type")


def _schema(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema given as an object, or as its JSON text (vLLM's clients send both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ApiError(400, f"{param}: not JSON: {exc}", "invalid_value", param) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{param}: a JSON schema is an object.", "invalid_value", param)
    return value
