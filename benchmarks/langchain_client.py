"""A real client against ``gpuflow serve`` (issue 53): LangChain's ``ChatOpenAI`` pointed
at the server with ``base_url``, its structured output and its tools.

SmolLM2-135M-Instruct (``real_model.py``'s directory, float32) is served with a ChatML
template that renders tools as Hermes and Qwen do (``<tools>`` in the system prompt, calls
in ``<tool_call>`` blocks), greedy. Each check says whether it worked and what came back:

- ``with_structured_output(Person, method="json_schema")`` and ``method="function_calling"``
  (constrained by the schema, or by the named function's parameters): a ``Person``;
- ``bind_tools([get_weather], tool_choice="required", strict=True,
  parallel_tool_calls=False)`` (constrained): one tool call whose arguments validate, then the
  tool's result sent back as a ``ToolMessage`` for an answer (``strict`` closes the
  parameters' schema, ``additionalProperties: false``: an open one lets the model add keys
  until ``max_tokens``, as this one does);
- ``bind_tools([get_weather])`` with ``auto`` (unconstrained: the model must choose to call,
  in the template's syntax; a 135M model may not), whole and streamed: the same call.

Needs ``pip install langchain-openai`` (the bench extra); not part of ``make test``.

    .venv/bin/python benchmarks/langchain_client.py          # ~1 minute
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402
    default_result_path,
    machine_info,
    package_version,
    provenance,
    stop,
    write_json,
)
from _load import start  # noqa: E402
from real_model import smollm2_directory  # noqa: E402
from serving import free_port  # noqa: E402

TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role != 'system' %}<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class Person(BaseModel):
    """A person described in the text."""

    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=130)
    city: str = Field(max_length=30)


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is 21 degrees and sunny in {city}."


PERSON = "Alice is 31 years old and lives in Paris. Describe her."
WEATHER = "What is the weather like in Paris right now? Use the tool."


def check(name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One check: what ``run`` found (``ok`` among it), or the exception that stopped it."""
    try:
        found = run()
    except Exception as exc:  # a client-side failure is a finding, not a crash
        found = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc(limit=3)}
    print(f"{name}: {'ok' if found['ok'] else 'FAILED'}", flush=True)
    return found


def structured(model: Any, method: str) -> dict[str, Any]:
    person = model.with_structured_output(Person, method=method).invoke(PERSON)
    return {"ok": isinstance(person, Person) and bool(Person.model_validate(person.model_dump())),
            "parsed": person.model_dump() if isinstance(person, Person) else repr(person)}


def called(message: Any) -> dict[str, Any]:
    calls = [{"name": c["name"], "args": c["args"]} for c in message.tool_calls]
    return {"ok": any(c["name"] == "get_weather" and isinstance(c["args"].get("city"), str)
                      for c in calls),
            "tool_calls": calls, "content": message.content,
            "finish_reason": message.response_metadata.get("finish_reason"),
            "invalid_tool_calls": [dict(c) for c in message.invalid_tool_calls]}


def required_round_trip(model: Any) -> dict[str, Any]:
    """A demanded call, its result sent back, and the model's answer in text."""
    from langchain_core.messages import HumanMessage, ToolMessage

    messages: list[Any] = [HumanMessage(WEATHER)]
    asked = model.bind_tools([get_weather], tool_choice="required", strict=True,
                             parallel_tool_calls=False).invoke(messages)
    found = called(asked)
    if not found["ok"]:
        return found
    call = asked.tool_calls[0]
    messages += [asked, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
    answer = model.bind_tools([get_weather]).invoke(messages)
    return {**found, "ok": bool(answer.content) and not answer.tool_calls,
            "answer": answer.content,
            "answer_finish_reason": answer.response_metadata.get("finish_reason")}


def auto(model: Any) -> dict[str, Any]:
    """The model's own choice, whole and streamed (the chunks added up as LangChain does)."""
    bound = model.bind_tools([get_weather])
    whole = called(bound.invoke(WEATHER))
    streamed = None
    for chunk in bound.stream(WEATHER):
        streamed = chunk if streamed is None else streamed + chunk
    again = called(streamed)
    return {**whole, "streamed": again,
            "streamed_matches": again["tool_calls"] == whole["tool_calls"]}


def served(model: Path, template: Path) -> tuple[Any, str]:
    port = free_port()
    command = [sys.executable, "-m", "gpuflow.cli", "serve", str(model), "--port", str(port),
               "--chat-template", str(template), "--served-model-name", "smollm2",
               "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    return start(command, url, "/readyz", dict(os.environ), timeout=300), url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from langchain_openai import ChatOpenAI

    with tempfile.TemporaryDirectory(prefix="langchain-") as scratch:
        template = Path(scratch) / "chatml-tools.jinja"
        template.write_text(TEMPLATE)
        process, url = served(smollm2_directory(), template)
        try:
            model = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="smollm2",
                               temperature=0, max_tokens=args.max_tokens, max_retries=0)
            checks = {
                "with_structured_output_json_schema": check(
                    "with_structured_output json_schema", lambda: structured(model, "json_schema")),
                "with_structured_output_function_calling": check(
                    "with_structured_output function_calling",
                    lambda: structured(model, "function_calling")),
                "bind_tools_required_round_trip": check(
                    "bind_tools required, round trip", lambda: required_round_trip(model)),
                "bind_tools_auto": check("bind_tools auto", lambda: auto(model)),
            }
        finally:
            stop([process])
    payload = {**provenance(langchain_openai=package_version("langchain-openai"),
                            langchain_core=package_version("langchain-core"),
                            openai=package_version("openai")),
               "machine": machine_info(), "model": "SmolLM2-135M-Instruct, float32",
               "chat_template": "ChatML, tools as Hermes and Qwen render them (TEMPLATE)",
               "greedy": True, "max_tokens": args.max_tokens,
               "checks": checks}
    out = args.out or default_result_path("langchain_client")
    write_json(out, payload)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
