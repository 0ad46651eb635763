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
from gpuflow.serve.routes.tool_parsers import syntax_of

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
        reply = await api.chat.completions.create(
            model="m", messages=conversation, tools=TOOLS, max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        [[name, arguments]] = [(c.function.name, c.function.arguments)
                               for c in reply.choices[0].message.tool_calls]
        assert name == "get_time" and reply.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(arguments), TIME)
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


FORCED = r'Ok\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}</tool_call>'


def test_streamed_tool_calls_are_the_whole_answers_calls_with_the_named_parser(
        random_llama: Path, tmp_path: Path) -> None:  # noqa: F811
    """Greedy answers streamed through the openai client join to the unstreamed ones:
    required, a named function, and a Hermes call in ``auto`` (forced by a regex) read by
    ``--tool-call-parser hermes`` from a model whose template shows Mistral's syntax."""
    template = tmp_path / "mistral-looking.jinja"
    template.write_text(TEMPLATE + "{# [TOOL_CALLS] #}")

    async def both(api: openai.AsyncOpenAI, **body: Any) -> tuple[Any, list[Any], str]:
        body = {"model": "m", "messages": ASK, "tools": TOOLS, "temperature": 0,
                "max_tokens": 150, **body}
        whole = (await api.chat.completions.create(**body)).choices[0]
        deltas, finish = [], ""
        async for chunk in await api.chat.completions.create(stream=True, **body):
            for choice in chunk.choices:
                deltas.append(choice.delta.model_dump(exclude_none=True))
                finish = choice.finish_reason or finish
        return whole, deltas, finish

    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        answers = await asyncio.gather(
            both(api, tool_choice="required", parallel_tool_calls=False),
            both(api, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
            both(api, extra_body={"guided_regex": FORCED}))
        for whole, deltas, finish in answers:
            calls = whole.message.tool_calls
            check_calls(calls)
            assert whole.finish_reason == finish == "tool_calls"
            assert merged(deltas) == (whole.message.content, [
                (call.function.name, call.function.arguments) for call in calls])
            assert sum("tool_calls" in delta for delta in deltas) > len(calls)  # in pieces
        forced = answers[2][0].message
        assert forced.content == "Ok." and forced.tool_calls[0].function.name == "get_time"

    served(random_llama, test, **SERVER, chat_template=str(template),
           tool_call_parser="hermes")


def test_tools_need_a_template_that_renders_them(random_llama: Path) -> None:  # noqa: F811
    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        reply = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"

    served(random_llama, test, **SERVER)


def merged(deltas: list[dict[str, Any]]) -> tuple[str | None, list[tuple[str, str]]]:
    """A stream's chat deltas put together as a client does: the content, and each call's
    name and arguments (its fragments joined); a call's first delta carries its id."""
    content = "".join(delta.get("content", "") for delta in deltas) or None
    calls: dict[int, list[str]] = {}
    for part in (part for delta in deltas for part in delta.get("tool_calls", [])):
        if "id" in part:
            assert part["index"] not in calls and part["id"] and part["type"] == "function"
            calls[part["index"]] = [part["function"]["name"], ""]
        calls[part["index"]][1] += part["function"]["arguments"]
    return content, [(name, arguments) for name, arguments in calls.values()]


UTC = '{"zone": "UTC"}'
ANSWERS = [  # (mode, syntax, the model's text, content, calls)
    ("auto", "hermes", f'Sure.\n<tool_call>\n{{"name": "get_time", "arguments": {UTC}}}\n'
     '</tool_call>\n<tool_call>{"arguments": "{\\"zone\\": \\"CET\\"}", "name": "get_time"}'
     "</tool_call> Done.", "Sure.\n\n Done.",
     [("get_time", UTC), ("get_time", '{"zone": "CET"}')]),
    ("auto", "hermes", "The time is <tool", "The time is <tool", []),
    ("auto", "hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "U',
     None, [("get_time", '{"zone": "U')]),
    ("auto", "mistral", f'[TOOL_CALLS][{{"name": "get_time", "arguments": {UTC}}}, '
     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None,
     [("get_time", UTC), ("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("auto", "mistral", f' [{{"name": "get_time", "arguments": {UTC}}}]', None,
     [("get_time", UTC)]),
    ("auto", "mistral", "[1, 2] is a list.", "[1, 2] is a list.", []),
    ("auto", "llama3_json", f'{{"name": "get_time", "parameters": {UTC}}}; '
     '{"name": "get_time", "parameters": {}}', None, [("get_time", UTC), ("get_time", "{}")]),
    ("auto", "llama3_json", '{"name": "Alice", "age": 3}', '{"name": "Alice", "age": 3}', []),
    ("required", "hermes", f'[{{"name": "get_time", "parameters": {UTC}}}]', None,
     [("get_time", UTC)]),
    ("get_time", "hermes", f" {UTC} ", None, [("get_time", UTC)]),
]


@pytest.mark.parametrize("mode, syntax, text, content, calls", ANSWERS)
def test_streamed_calls_join_to_the_whole_answer_wherever_the_text_is_cut(
        mode: str, syntax: str, text: str, content: str | None,
        calls: list[tuple[str, str]]) -> None:
    """Every syntax, cut at every point into two pieces and fed a character at a time:
    the deltas join to the unstreamed answer, and text that could begin a call is never
    sent as content."""
    plan = ToolPlan(mode, {name: FunctionSpec(name=name, parameters=schema)
                           for name, schema in SCHEMAS.items()}, True, syntax)
    found, whole = plan.reader().message(text)
    assert (found, [(c["function"]["name"], c["function"]["arguments"]) for c in whole]) \
        == (content, calls)
    for pieces in [*([text[:cut], text[cut:]] for cut in range(len(text) + 1)), list(text)]:
        reader = plan.reader()
        deltas = [reader.feed(piece) for piece in pieces]
        assert merged([*deltas, reader.finish()]) == (content, calls), pieces
        assert reader.called == bool(calls)
        if calls and content is None:
            assert not any("content" in delta for delta in deltas)


def test_the_parser_is_the_named_one_or_the_templates() -> None:
    assert syntax_of("auto", "{{ '[TOOL_CALLS]' }}") == "mistral"
    assert syntax_of("auto", "<|python_tag|>{{ x }}") == "llama3_json"
    assert syntax_of("auto", TEMPLATE) == syntax_of("auto", None) == "hermes"
    assert syntax_of("hermes", "{{ '[TOOL_CALLS]' }}") == "hermes"


def test_an_app_built_from_python_refuses_an_unknown_parser() -> None:
    from gpuflow.serve.app import ServeSettings, create_app

    with pytest.raises(ValueError, match="tool_call_parser 'qwen' is not one of auto, hermes"):
        create_app(ServeSettings("model", tool_call_parser="qwen"))


def test_serve_takes_tool_call_parser_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``--tool-call-parser`` reaches the settings; an unknown name exits 2 naming the
    choices; ``--help`` lists them."""
    import os

    import uvicorn

    from gpuflow.cli import main
    from gpuflow.serve.settings import SETTINGS_ENV, settings_from_json

    (tmp_path / "config.json").write_text("{}")
    seen: list[str] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: seen.append(os.environ[SETTINGS_ENV]))
    monkeypatch.setenv(SETTINGS_ENV, "")
    assert main(["serve", str(tmp_path), "--tool-call-parser", "mistral"]) in (0, None)
    assert main(["serve", str(tmp_path)]) in (0, None)
    assert [settings_from_json(s).tool_call_parser for s in seen] == ["mistral", "auto"]
    with pytest.raises(SystemExit) as exited:
        main(["serve", str(tmp_path), "--tool-call-parser", "qwen"])
    assert exited.value.code == 2
    assert "invalid choice: 'qwen'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--tool-call-parser {auto,hermes,mistral,llama3_json}" in capsys.readouterr().out
