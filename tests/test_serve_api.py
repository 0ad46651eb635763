"""The server's HTTP surface: the token, body limits, unknown routes and methods and body errors
in OpenAI's error envelope; /healthz, /readyz and the OpenAPI schema."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import pytest
from conftest import api_error, serving
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from serve_probe import Probe, probe_app, probe_engine, rows, run

from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.engine import Engine, EngineOptions
from gpuflow.serve.errors import invalid_body


def test_token_body_limit_unknown_routes_and_methods_answer_in_the_envelope() -> None:
    async def scenario() -> None:
        app = probe_app(Probe(), token="s3cret", max_body_bytes=200)
        async with serving(app) as client:
            missing = await client.post("/v1/predict", json=rows(1))
            wrong = await client.get("/healthz", headers={"Authorization": "Bearer nope"})
            auth = {"Authorization": "Bearer s3cret"}
            good = await client.post("/v1/predict", json=rows(1), headers=auth)
            big = await client.post("/v1/predict", json=rows(*range(40)), headers=auth)

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(10):
                    yield b" " * 50

            chunked = await client.post("/v1/predict", content=chunks(),
                                        headers={**auth, "Content-Type": "application/json"})
            bad = await client.post("/v1/predict", json={"inputs": [[1, 2]]}, headers=auth)
            invalid = await client.post("/v1/predict", json={"inputs": [[1, 2, 3, 4]],
                                                             "top_k": "many"}, headers=auth)
            nowhere = await client.post("/v1/nowhere", json={}, headers=auth)
            wrong_method = await client.get("/v1/predict", headers=auth)
            after = await client.post("/v1/predict", json=rows(1), headers=auth)
        assert api_error(missing, 401)["code"] == "unauthorized"
        assert api_error(wrong, 401)["code"] == "unauthorized"
        assert missing.headers["www-authenticate"] == "Bearer"
        assert good.status_code == 200 and after.status_code == 200
        assert api_error(big, 413)["code"] == "body_too_large"
        assert api_error(chunked, 413)["code"] == "body_too_large"
        assert "[N, 4]" in api_error(bad, 422)["message"]
        refused = api_error(invalid, 422)
        assert refused["code"] == "invalid_request" and refused["param"] == "top_k"
        assert refused["details"][0]["loc"] == ["top_k"]
        assert api_error(nowhere, 404)["code"] == "not_found"
        assert "/v1/nowhere" in nowhere.json()["error"]["message"]
        assert api_error(wrong_method, 405)["code"] == "method_not_allowed"
        assert wrong_method.headers["allow"] == "POST"

    run(scenario)


class Part(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[Part, Field(discriminator="type")]]


class Chat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: list[Message]


@pytest.mark.parametrize(("body", "param", "said"), [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'user'"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text", "valid string"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "valid string or Input should be a valid list"),
    ({"messages": [], "tools": []}, "tools", "Unrecognized request argument supplied: tools"),
])
def test_a_body_error_names_the_field_as_the_client_spelled_it(
        body: dict[str, Any], param: str, said: str) -> None:
    """The dotted path to the field at fault, without the names pydantic gives a union's
    alternatives (``content.list[...].0``), the furthest any alternative got."""
    with pytest.raises(ValidationError) as raised:
        Chat.model_validate(body)
    error = invalid_body(raised.value, Chat)
    assert (error.status, error.param, error.code) == (400, param, "invalid_request")
    assert said in error.message and param.split(".")[0] in error.message


def test_readyz_turns_200_only_after_loading_and_warm_up() -> None:
    probe = Probe()
    loading = threading.Event()

    def load() -> Engine:
        assert loading.wait(30)
        return probe_engine(probe, EngineOptions(device="cpu", max_batch_size=4))

    async def scenario() -> None:
        app = create_app(ServeSettings("probe", max_batch_size=4), load=load)
        async with serving(app, ready=False) as client:
            alive = await client.get("/healthz")
            before = await client.get("/readyz")
            early = await client.post("/v1/predict", json=rows(1))
            probe.seen.clear()
            loading.set()
            await asyncio.wait_for(app.state.serve.ready.wait(), 30)
            after = await client.get("/readyz")
            docs = await client.get("/openapi.json")
        assert alive.status_code == 200
        assert before.status_code == 503 and before.json()["state"] == "loading"
        assert api_error(early, 503)["code"] == "not_ready"
        assert after.status_code == 200 and after.json()["warmup_s"] >= 0
        # Every warm-up batch ran before ready: eager, one row per kind of input.
        warmup = app.state.serve.engine.warmup_batches()
        assert len(probe.seen) == sum(len(batch) for _, batch in warmup) == 1
        paths = docs.json()["paths"]
        for path, field in (("/v1/predict", "inputs"), ("/v1/completions", "prompt")):
            body = paths[path]["post"]["requestBody"]["content"]["application/json"]
            assert field in body["schema"]["properties"], path

    run(scenario)
