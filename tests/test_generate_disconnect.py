"""A generation whose client leaves before its first token: it gives up its place in the
engine's waiting queue at once and is never computed; the others complete."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from conftest import eventually, serving
from serve_probe import metric

from gpuflow.models.gpt import GPT
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.generate.models import GPTDecoder


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_while_queued_is_dropped_and_others_complete(
    textlm_run: tuple[Path, GPT], monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    step = GPTDecoder.forward

    def slow(self, *args, **kwargs):  # 20 ms a step: the running request takes ~0.8 s
        time.sleep(0.02)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(GPTDecoder, "forward", slow)

    async def scenario() -> tuple[httpx.Response, httpx.Response, str]:
        app = create_app(ServeSettings(str(textlm_run[0]), device="cpu", max_batch_size=1,
                                       engine_process=False))
        async with serving(app) as client:
            generator = app.state.serve.generator
            body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
            running = asyncio.create_task(client.post("/v1/completions",
                                                      json={**body, "prompt": "ab"}))
            await eventually(lambda: generator.active == 1)
            # One sequence runs at a time (--max-batch-size 1): this one must queue.
            leaving = asyncio.create_task(client.post("/v1/completions", json={
                **body, "prompt": "cd", "stream": stream}))
            await eventually(lambda: generator.waiting == 1)
            leaving.cancel()  # closes its connection
            await eventually(lambda: generator.waiting == 0, timeout=2)
            assert not running.done()  # dropped while the other still ran, not after it
            first = await running
            after = await client.post("/v1/completions", json={**body, "prompt": "ef"})
            return first, after, (await client.get("/metrics")).text

    first, after, text = asyncio.run(scenario())
    assert first.status_code == 200 and after.status_code == 200
    assert first.json()["usage"]["completion_tokens"] == 40
    assert metric(text, "gpuflow_waiting_sequences") == 0
    assert metric(text, "gpuflow_generated_tokens_total") == 80  # the queued one made none
