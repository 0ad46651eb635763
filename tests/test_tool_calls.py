"""Tool calls on /v1/chat/completions through the official openai client, on the random-weight
Llama of ``test_structured_output`` with a Hermes-style chat template that renders tools:
``required`` and a named function always give calls whose arguments validate, whole and
streamed, the tool's result goes back in the conversation, ``none`` answers in text, and
bad tool requests are 400s naming their parameter. The parsers read the common syntaxes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from test_serve_model_dir import served
from test_structured_output import SERVER, random_llama  # noqa: F401  (a fixture)

from gpuflow.serve.routes.tool_calls import FunctionSpec, ToolPlan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: "
    "{{ tools | map(attribute='function.name') | join(', ') }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def check_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id and call.type == "function"


def test_a_tool_call_round_trip_through_the_openai_client(random_llama: Path,  # noqa: F811
                                                          tmp_path: Path) -> None:
    template = tmp_path / "tools.jinja"
    template.write_text(TEMPLATE)

    async def streamed(api: openai.AsyncOpenAI, **body: Any) -> tuple[dict[int, dict], str]:
        calls: dict[int, dict] = {}
        finish = ""
        async for chunk in await api.chat.completions.create(model="m", stream=True, **body):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for call in choice.delta.tool_calls or []:
                    calls[call.index] = call.model_dump()
        return calls, finish

    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        required, single, text = await asyncio.gather(
            api.chat.completions.create(model="m", messages=ASK, tools=TOOLS, seed=1,
                                        tool_choice="required", max_tokens=150),
            api.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0,
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_tokens=150),
            api.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                        tool_choice="none", max_tokens=6))
        message = required.choices[0].message
        assert required.choices[0].finish_reason == "tool_calls"
        check_calls(message.tool_calls)
        assert len(single.choices[0].message.tool_calls) == 1
        check_calls(single.choices[0].message.tool_calls)
        assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
        call = single.choices[0].message.tool_calls[0]
        conversation = [*ASK, single.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
        calls, finish = await streamed(
            api, messages=conversation, tools=TOOLS, max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert finish == "tool_calls" and list(calls) == [0]
        assert calls[0]["function"]["name"] == "get_time"
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), TIME)
        for body, param in (
                ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                 "tool_choice"),
                ({"tools": None, "tool_choice": "required"}, "tool_choice"),
                ({"response_format": {"type": "json_object"}, "tool_choice": "required"},
                 "tool_choice")):
            reply = await client.post("/v1/chat/completions",
                                      json={"messages": ASK, "tools": TOOLS, **body})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param, body
        plain = await client.post("/v1/completions", json={"prompt": "x", "tools": TOOLS})
        assert plain.status_code == 400 and plain.json()["error"]["param"] == "tools"

    served(random_llama, test, **SERVER, chat_template=str(template))


def test_tools_need_a_template_that_renders_them(random_llama: Path) -> None:  # noqa: F811
    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        reply = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"

    served(random_llama, test, **SERVER)


@pytest.mark.parametrize("text, content", [
    ('Sure.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "Sure."),
    ('[{"name": "get_time", "arguments": {"zone": "UTC"}}]', None),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]', None),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', None),
])
def test_auto_reads_hermes_mistral_and_llama3_calls(text: str, content: str | None) -> None:
    plan = ToolPlan("auto", {"get_time": FunctionSpec(name="get_time", parameters=TIME)}, True)
    found, calls = plan.read(text)
    assert found == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_time", {"zone": "UTC"})]
    assert plan.read("The time is noon.") == ("The time is noon.", [])
