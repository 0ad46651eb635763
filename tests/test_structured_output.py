"""Structured outputs (``response_format``, vLLM's ``guided_*``) through the server, on a
Llama directory with RANDOM weights (the Hub-style tokenizer of ``hub_models``): whatever
the model prefers, the grammar alone makes every output valid. Over 22 JSON schemas, greedy
and sampled, on both routes, every output parses and validates with ``jsonschema``; so do
regexes, choices and grammars, streamed and with ``n`` > 1, beside unconstrained greedy
requests (whose steps may stay in flight); ``max_tokens`` inside a value ends with ``length``;
the openai client's ``beta.chat.completions.parse`` returns its pydantic object; bad
grammars are 400s naming their parameter; the core in its own process (with speculative
decoding for the unconstrained rows) constrains too; a constrained greedy row is chosen on
the host, never left in flight."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch
from test_serve_model_dir import served

from gpuflow.serve.generate.core_request import CoreRequest
from gpuflow.serve.generate.grammar import Constraint, Grammars, Vocabulary
from gpuflow.serve.generate.sampling import SamplingParams
from gpuflow.serve.generate.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENUM = {"enum": ["red", "green", "blue"]}
NAME = {"type": "string", "maxLength": 8}
# Bounded: a random greedy model writes digits for ever where the grammar lets it.
INT = {"type": "integer", "minimum": -50, "maximum": 50}


def closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object with exactly these properties (all required unless told), as OpenAI's
    strict mode writes them: a random model would otherwise add properties for ever."""
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "required": list(properties) if required is None else required}


SCHEMAS: list[dict[str, Any]] = [
    closed({"a": INT}),
    closed({"ok": {"type": "boolean"}, "none": {"type": "null"}}),
    closed({"age": {"type": "integer", "minimum": 18, "maximum": 99}}),
    closed({"p": {"type": "number", "minimum": 0, "maximum": 1}}),
    closed({"t": {"type": "number", "exclusiveMinimum": -5, "maximum": 5}}),
    closed({"colour": ENUM}),
    closed({"name": NAME, "nick": NAME}, required=["name"]),
    closed({"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    closed({"key": {"type": "string", "format": "uuid"}}),
    closed({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    closed({"grid": {"type": "array", "maxItems": 2,
                     "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                          "maximum": 9}, "maxItems": 3}}}),
    closed({"point": closed({"x": INT, "y": INT})}),
    closed({"user": closed({"name": NAME, "address": closed({"city": NAME, "zip": {
        "type": "string", "pattern": "^[0-9]{5}$"}})})}),
    closed({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, ENUM]}}),
    closed({"shape": {"anyOf": [closed({"r": {"type": "number", "minimum": 0, "maximum": 9}}),
                                closed({"w": INT, "h": INT})]}}),
    closed({"mode": {"const": "fast"}, "level": {"type": "integer", "minimum": 1,
                                                  "maximum": 3}}),
    closed({"a": INT, "b": {"type": "boolean"}, "c": ENUM}, required=["c"]),
    closed({"items": {"type": "array", "minItems": 2, "maxItems": 2,
                      "items": closed({"sku": NAME, "qty": {"type": "integer", "minimum": 1,
                                                            "maximum": 5}})}}),
    {"type": "array", "items": ENUM, "minItems": 1, "maxItems": 4},
    {"type": "integer", "minimum": -100, "maximum": 100},
    ENUM,
    {"$defs": {"leaf": closed({"label": NAME})},
     "type": "object", "additionalProperties": False, "required": ["left", "right"],
     "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}}},
]
CHAT = [{"role": "user", "content": "Answer in JSON."}]
# One server answers each test's requests at once: room for all of them.
SERVER = {"served_model_name": ("m",), "max_batch_size": 16, "kv_cache_gib": 0.05,
          "timeout_ms": 120000}
REGEX = r"[A-Z][a-z]{1,5}-[0-9]{2,4}"
CHOICES = ["yes", "no", "maybe not"]


@pytest.fixture(scope="module")
def random_llama(hub_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Hub-style Llama directory with fresh random weights (seeded): its tokenizer,
    chat template and two EOS ids, and no preference a grammar could lean on."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source, out = hub_models["llama"], tmp_path_factory.mktemp("random-llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).save_pretrained(out)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out / path.name)
    return out


def valid(schema: dict[str, Any], text: str) -> None:
    jsonschema.validate(json.loads(text), schema,
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


async def stream_texts(api: openai.AsyncOpenAI, n: int, **body: Any) -> tuple[list[str],
                                                                              list[str]]:
    """Each choice's streamed text and finish reason."""
    texts, finishes = [""] * n, [""] * n
    async for chunk in await api.chat.completions.create(model="m", messages=CHAT, n=n,
                                                         stream=True, **body):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    return texts, finishes


def test_every_constrained_output_of_a_random_model_is_valid(random_llama: Path) -> None:
    """All at once on one server: each schema greedy through chat's ``response_format``
    and sampled (n=2) through completions' ``guided_json``; regexes, choices, a Lark and a
    GBNF grammar, ``json_object``; streamed with n=2 and log-probabilities; beside
    unconstrained greedy requests. Every constrained output finishes ``stop`` and is
    valid; the mask time shows in /metrics."""

    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        async def chat(schema: dict[str, Any]) -> tuple[str, str]:
            reply = await api.chat.completions.create(
                model="m", messages=CHAT, temperature=0, max_tokens=160,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "answer", "schema": schema,
                                                 "strict": True}})
            return reply.choices[0].message.content or "", reply.choices[0].finish_reason

        async def sampled(seed: int, **body: Any) -> list[tuple[str, str]]:
            reply = await api.completions.create(
                model="m", prompt="Data:", temperature=1.0, seed=seed, n=2, max_tokens=160,
                extra_body=body)
            return [(c.text, c.finish_reason) for c in reply.choices]

        plain = [api.completions.create(model="m", prompt="Hello", temperature=0,
                                        max_tokens=24) for _ in range(2)]
        greedy = [chat(schema) for schema in SCHEMAS]
        samples = [sampled(seed, guided_json=schema) for seed, schema in enumerate(SCHEMAS)]
        others = [sampled(1, guided_regex=REGEX), sampled(2, guided_choice=CHOICES),
                  sampled(3, guided_grammar='start: "(" item ("," item)* ")"\n'
                                            'item: /[0-9]/ | "x"'),
                  sampled(4, guided_grammar='root ::= "on" | "off" | "auto"'),
                  sampled(5, response_format={"type": "json_object"})]
        streamed = stream_texts(api, 2, temperature=1.0, max_tokens=160, logprobs=True,
                                response_format={"type": "json_schema", "json_schema": {
                                    "name": "s", "schema": SCHEMAS[12]}})
        results = await asyncio.gather(*plain, *greedy, *samples, *others, streamed)
        results = results[len(plain):]
        for schema, (text, finish) in zip(SCHEMAS, results, strict=False):
            assert finish == "stop", (schema, text)
            valid(schema, text)
        for schema, pair in zip(SCHEMAS, results[len(SCHEMAS):], strict=False):
            for text, finish in pair:
                assert finish == "stop", (schema, text)
                valid(schema, text)
        regex, choice, lark, gbnf, anything = results[2 * len(SCHEMAS):-1]
        assert all(re.fullmatch(REGEX, text) for text, _ in regex), regex
        assert all(text in CHOICES for text, _ in choice), choice
        assert all(re.fullmatch(r"\((x|[0-9])(,(x|[0-9]))*\)", text) for text, _ in lark)
        assert all(text in ("on", "off", "auto") for text, _ in gbnf), gbnf
        for text, finish in anything:  # any object: a random model's keys may never end
            assert text.startswith("{") and (finish == "length"
                                              or isinstance(json.loads(text), dict)), text
        texts, finishes = results[-1]
        assert finishes == ["stop", "stop"]
        for text in texts:
            valid(SCHEMAS[12], text)
        metrics = (await client.get("/metrics")).text
        count = re.search(r"^gpuflow_engine_grammar_mask_seconds_count (\S+)$", metrics, re.M)
        assert count is not None and float(count.group(1)) > 0

    served(random_llama, test, **SERVER)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=4)


BAD = [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"not": {"type": "string"}}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "string", "pattern": "(?<=a)b"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
]


def test_limits_parse_and_refusals(random_llama: Path) -> None:
    """``max_tokens`` inside the value ends with ``length``; ``beta...parse`` with a
    pydantic model returns the parsed object (whole and with n=2); bad grammars and
    formats are 400s naming their parameter, saying why (the schema's keyword)."""

    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        cut = await api.chat.completions.create(
            model="m", messages=CHAT, max_tokens=3, temperature=0,
            response_format={"type": "json_schema", "json_schema": {
                "name": "a", "schema": SCHEMAS[12]}})
        assert cut.choices[0].finish_reason == "length"
        parsed = await api.beta.chat.completions.parse(model="m", messages=CHAT, n=2,
                                                       response_format=Pet, max_tokens=80)
        assert all(isinstance(choice.message.parsed, Pet) for choice in parsed.choices)
        for body, param in BAD:
            for route, base in (("chat/completions", {"messages": CHAT}),
                                ("completions", {"prompt": "x"})):
                reply = await client.post(f"/v1/{route}", json={**base, **body})
                error = reply.json()["error"]
                assert reply.status_code == 400 and error["param"] == param, (body, error)
        refused = await client.post("/v1/completions", json={"prompt": "x", **BAD[2][0]})
        assert '"not"' in refused.json()["error"]["message"]

    served(random_llama, test, **SERVER)


def test_the_core_in_its_own_process_constrains_with_speculation_on(
        random_llama: Path) -> None:
    """The vocabulary and grammars cross to the core's process; unconstrained rows draft
    by prompt lookup while constrained rows (never drafted) stay valid."""

    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        replies = await asyncio.gather(
            api.completions.create(model="m", prompt="a b a b a b", max_tokens=16,
                                   temperature=0),
            *(api.completions.create(model="m", prompt="x", max_tokens=160, temperature=t,
                                     extra_body={"guided_json": SCHEMAS[i]})
              for i, t in ((11, 0.0), (17, 1.0))))
        for reply, schema in zip(replies[1:], (SCHEMAS[11], SCHEMAS[17]), strict=True):
            assert reply.choices[0].finish_reason == "stop"
            valid(schema, reply.choices[0].text)

    served(random_llama, test, **SERVER, engine_process=True, num_speculative_tokens=2)


def test_a_constrained_greedy_row_is_chosen_on_the_host_among_what_its_grammar_allows(
) -> None:
    """Never left in flight on the device (its mask needs its last token); its argmax is
    over the allowed tokens; it stops where its grammar ends (a byte vocabulary, no EOS)."""
    grammars = Grammars(Vocabulary.of(ByteTokenizer(), 256))
    params = SamplingParams(max_tokens=8, temperature=0.0, constraint=Constraint.choice(["ab"]))
    assert params.constraint is not None
    plain = CoreRequest(0, [1, 2], SamplingParams(temperature=0.0))
    constrained = CoreRequest(1, [1, 2], params, grammars.guide(params.constraint))
    assert plain.device_sampled and not constrained.device_sampled
    logits = torch.zeros(256)
    logits[ord("z")], logits[ord("a")] = 5.0, 1.0
    first = constrained.sampler.choose(logits)
    assert first == ord("a") and constrained.take(first, None, frozenset(), 64) is None
    assert constrained.guide is not None
    constrained.guide.prepare()  # as the core does while the forward runs
    second = constrained.sampler.choose(logits)
    assert second == ord("b") and constrained.take(second, None, frozenset(), 64) == "stop"


def test_a_grammar_compiling_in_the_core_holds_up_no_other_request(
        random_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the core compiles a grammar new to it (held here until released), other
    requests step and finish; then the constrained one runs."""
    release = threading.Event()
    guide = Grammars.guide

    def held(self: Grammars, constraint: Constraint) -> Any:
        release.wait(30)
        return guide(self, constraint)

    monkeypatch.setattr(Grammars, "guide", held)

    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        constrained = asyncio.ensure_future(api.completions.create(
            model="m", prompt="x", max_tokens=40, temperature=0,
            extra_body={"guided_choice": CHOICES}))
        plain = await api.completions.create(model="m", prompt="Hello", max_tokens=8,
                                             temperature=0)
        assert plain.choices[0].finish_reason == "length" and not constrained.done()
        release.set()
        assert (await constrained).choices[0].text in CHOICES

    served(random_llama, test, **SERVER)
