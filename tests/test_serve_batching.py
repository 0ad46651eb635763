"""The dynamic batcher behind /v1/predict: who runs when, bounded queues and deadlines,
failures kept to their batch; on real uvicorn with a probe model."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from conftest import api_error, eventually, serving
from serve_probe import (
    Probe,
    holding_the_model,
    metric,
    probe_app,
    probe_engine,
    queued_behind_the_model,
    rows,
    run,
)

from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.engine import Engine, EngineOptions
from gpuflow.serving import PredictRequest


def test_a_lone_request_runs_at_once_however_long_batches_may_wait() -> None:
    async def scenario() -> None:
        app = probe_app(Probe(), max_wait_ms=10_000)
        async with serving(app) as client:
            replies = [(await client.post("/v1/predict", json=rows(i))).json()
                       for i in range(3)]
        # Nobody else was on the way: no request waited for company.
        assert all(r["batch_rows"] == 1 and r["queue_ms"] < 1000 for r in replies), replies

    run(scenario)


def test_fast_lone_requests_run_on_the_event_loop_and_slow_ones_are_handed_off() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, inline_below_ms=50)
        async with serving(app) as client:
            loop_thread = threading.current_thread().name
            probe.threads.clear()  # the warm-up's
            probe.seen.clear()
            for value in range(3):
                assert (await client.post("/v1/predict", json=rows(value))).status_code == 200
            # A key's first lone run is timed on the batch thread; known fast, the next run
            # where the request arrived.
            assert probe.threads[0].startswith("gpuflow-batch")
            assert probe.threads[1:] == [loop_thread] * 2
            probe.delay_s = 0.4  # the model turns slow: the estimate passes 50 ms
            replies = [await client.post("/v1/predict", json=rows(value)) for value in (3, 4)]
        assert [r.status_code for r in replies] == [200, 200]
        assert probe.threads[3] == loop_thread and probe.threads[4].startswith("gpuflow-batch")
        assert probe.seen == [0.0, 1.0, 2.0, 3.0, 4.0]

    run(scenario)


def test_requests_arriving_while_a_batch_runs_form_the_next_batch() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, max_wait_ms=10_000)
        async with serving(app) as client:
            first, later = await queued_behind_the_model(app, probe, client, 0,
                                                         list(range(1, 8)))
            probe.gate.set()
            replies = [await first, *await asyncio.gather(*later)]
            text = (await client.get("/metrics")).text
        assert [r.status_code for r in replies] == [200] * 8
        assert [r.json()["batch_rows"] for r in replies] == [1] + [7] * 7
        # The seven ran as soon as the model was free, not after --max-wait-ms.
        assert all(r.json()["queue_ms"] < 5000 for r in replies[1:])
        assert metric(text, "gpuflow_batch_size_count") == 2
        assert metric(text, "gpuflow_batch_size_sum") == 8
        assert metric(text, 'gpuflow_requests_total{status="200"}') == 8
        assert metric(text, "gpuflow_request_latency_seconds_count") == 8
        assert metric(text, "gpuflow_queue_time_seconds_count") == 8
        assert metric(text, "gpuflow_compute_time_seconds_count") == 8
        assert metric(text, "gpuflow_queue_depth") == 0
        assert metric(text, "gpuflow_in_flight_requests") == 0

    run(scenario)


def test_a_full_queue_answers_503_with_retry_after() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, max_queue=1, max_wait_ms=0)
        async with serving(app) as client:
            running, [queued] = await queued_behind_the_model(app, probe, client, 1, [2])
            refused = await client.post("/v1/predict", json=rows(3))
            probe.gate.set()
            assert (await running).status_code == 200 and (await queued).status_code == 200
        assert api_error(refused, 503)["code"] == "queue_full"
        assert refused.headers["retry-after"] == "1"
        assert "queue is full" in refused.json()["error"]["message"]
        assert 3.0 not in probe.seen

    run(scenario)


def test_a_deadline_passing_in_the_queue_gives_504_and_the_model_never_sees_it() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, max_wait_ms=0)
        async with serving(app) as client:
            probe.seen.clear()
            running = await holding_the_model(probe, client, 1)
            late = await client.post("/v1/predict", json={**rows(7), "timeout_ms": 50})
            # The first batch still holds the model: the deadline fired while waiting.
            assert late.status_code == 504 and not probe.gate.is_set()
            assert app.state.serve.batcher.depth == 0
            probe.gate.set()
            assert (await running).status_code == 200
            after = await client.post("/v1/predict", json=rows(2))
            text = (await client.get("/metrics")).text
        assert api_error(late, 504)["code"] == "deadline_exceeded"
        assert after.status_code == 200
        assert probe.seen == [1.0, 2.0]
        assert metric(text, 'gpuflow_requests_total{status="504"}') == 1

    run(scenario)


def test_a_client_that_disconnects_leaves_the_queue() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, max_wait_ms=0)
        async with serving(app) as client:
            probe.seen.clear()
            running, [leaving] = await queued_behind_the_model(app, probe, client, 1, [5])
            leaving.cancel()  # closes its connection
            await eventually(lambda: app.state.serve.batcher.depth == 0)
            probe.gate.set()
            assert (await running).status_code == 200
            text = (await client.get("/metrics")).text
        assert probe.seen == [1.0]
        assert metric(text, 'gpuflow_requests_total{status="499"}') == 1

    run(scenario)


def test_a_failing_batch_fails_only_its_requests_and_serving_goes_on() -> None:
    probe = Probe()

    async def scenario() -> None:
        app = probe_app(probe, max_wait_ms=0)
        async with serving(app) as client:
            # Queued together behind the held batch, so they form the next batch.
            healthy, poisoned = await queued_behind_the_model(app, probe, client, 1, [-1, 4])
            probe.gate.set()
            first = await healthy
            failed = await asyncio.gather(*poisoned)
            after = await client.post("/v1/predict", json=rows(2))
        assert first.status_code == 200 and after.status_code == 200
        assert [r.status_code for r in failed] == [500, 500]
        body = api_error(failed[0], 500)
        assert body["code"] == "batch_failed" and "poisoned row" in body["message"]

    run(scenario)


def test_an_error_no_handler_answers_gives_500_and_serving_goes_on() -> None:
    probe = Probe()
    broken = [True]

    def load() -> Engine:
        engine = probe_engine(probe, EngineOptions(device="cpu"))
        answer = engine.codec.format

        def format(output: Any, parsed: PredictRequest) -> Any:
            if broken[0]:
                raise RuntimeError("the answer could not be written")
            return answer(output, parsed)

        engine.codec.format = format  # type: ignore[method-assign]
        return engine

    async def scenario() -> None:
        app = create_app(ServeSettings(source="probe", device="cpu", max_batch_size=8),
                         load=load)
        async with serving(app) as client:
            failed = await client.post("/v1/predict", json=rows(1))
            broken[0] = False
            after = await client.post("/v1/predict", json=rows(2))
            text = (await client.get("/metrics")).text
        assert api_error(failed, 500) == {
            "message": "RuntimeError: the answer could not be written", "type": "server_error",
            "param": None, "code": "internal"}
        assert after.status_code == 200
        assert metric(text, 'gpuflow_requests_total{status="500"}') == 1

    run(scenario)
