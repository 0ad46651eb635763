"""Tool calls on chat: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, the
grammar that makes calls always parse when the request demands one, and the model's text
read back as ``tool_calls``.

The tools reach the model through its chat template (``apply_chat_template(tools=...)``).
With ``auto`` the model calls in its own syntax, read back by ``tool_parsers.py``. With
``required`` or a named function the text is constrained, as vLLM does: a JSON list of
``{"name", "parameters"}`` (each one of the tools, its parameters by the tool's schema), or
the named function's arguments alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gpuflow.serve.errors import ApiError
from gpuflow.serve.generate.grammar import Constraint
from gpuflow.serve.routes.tool_parsers import ToolCallReader, reader


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call an assistant message made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """As chat templates read calls: arguments as an object where they parse."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools shape its answer: ``mode`` is ``auto``, ``required`` or
    the named function's name; ``tools`` by name; ``syntax`` the model's calls' (one of
    ``tool_parsers.SYNTAXES``)."""

    mode: str
    tools: dict[str, FunctionSpec]
    parallel: bool
    syntax: str

    @classmethod
    def of(cls, tools: list[ToolSpec] | None, choice: ToolChoice | None,
           parallel: bool | None, syntax: str) -> ToolPlan | None:
        """The plan, None when no tool may be called; 400 naming ``tool_choice`` for a
        choice that names no tool of ``tools``."""
        if choice is not None and not tools:
            raise ApiError(400, "tool_choice needs tools.", "invalid_value", "tool_choice")
        if not tools or choice == "none":
            return None
        by_name = {tool.function.name: tool.function for tool in tools}
        mode = "auto" if choice is None else choice
        if isinstance(mode, NamedToolChoice):
            if mode.function.name not in by_name:
                raise ApiError(400, f"tool_choice: {mode.function.name!r} is not one of the "
                               f"tools ({', '.join(by_name)}).", "invalid_value", "tool_choice")
            mode = mode.function.name
        return cls(mode, by_name, parallel is not False, syntax)

    def constraint(self) -> Constraint | None:
        """The grammar a demanded call follows; None for ``auto``."""
        if self.mode == "auto":
            return None
        if self.mode != "required":
            return Constraint.json_schema(_parameters(self.tools[self.mode]))
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "additionalProperties": False,
             "required": ["name", "parameters"],
             "properties": {"name": {"const": name}, "parameters": _parameters(function)}}
            for name, function in self.tools.items()]}}
        if not self.parallel:
            calls["maxItems"] = 1
        return Constraint.json_schema(calls)

    def reader(self) -> ToolCallReader:
        """A reader of one choice's text, streamed or whole."""
        return reader(self.mode, self.syntax, set(self.tools))


def _parameters(function: FunctionSpec) -> dict[str, Any]:
    return function.parameters or {"type": "object"}
