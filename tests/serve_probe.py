"""A probe model for the server tests: a classifier that records the rows and threads it ran
on and can be held at a gate, served without a run dir; and small helpers to drive it."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from fastapi import FastAPI
from torch import nn
from torch.utils.data import TensorDataset

from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.engine import Engine, EngineOptions
from gpuflow.serve.model import LoadedModel
from gpuflow.workload import Workload


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


class Probe(nn.Module):
    """A 4-feature classifier that records the rows it sees and the thread it ran on, can
    hold a batch at a gate or be slow, and raises on a batch holding a row whose first
    feature is -1."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.seen: list[float] = []
        self.threads: list[str] = []
        self.delay_s = 0.0
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x[:, 0].tolist()
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        self.entered.set()
        assert self.gate.wait(30)
        if bool((x[:, 0] == -1).any()):
            raise RuntimeError("poisoned row")
        return self.linear(x)


def probe_engine(probe: Probe, options: EngineOptions) -> Engine:
    data = TensorDataset(torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64))
    return Engine(LoadedModel(Workload("probe", probe.eval(), data), {}, 0, Path("probe")),
                  options)


def probe_app(probe: Probe, **settings: Any) -> FastAPI:
    # Batches held at the probe's gate must not hold the event loop (and the test) too.
    serve = ServeSettings(**{"source": "probe", "device": "cpu", "max_batch_size": 8,
                             "inline_below_ms": 0, **settings})
    return create_app(serve, load=lambda: probe_engine(probe, serve.engine_options()))


async def holding_the_model(probe: Probe, client: httpx.AsyncClient, value: float
                            ) -> asyncio.Task[httpx.Response]:
    """A request whose batch holds the model at the probe's gate until it is set."""
    probe.entered.clear()
    probe.gate.clear()
    running = asyncio.create_task(client.post("/v1/predict", json=rows(value)))
    assert await asyncio.to_thread(probe.entered.wait, 10)
    return running


async def queued_behind_the_model(app: FastAPI, probe: Probe, client: httpx.AsyncClient,
                                  held: float, queued: list[float]
                                  ) -> tuple[asyncio.Task[httpx.Response],
                                             list[asyncio.Task[httpx.Response]]]:
    """A request holding the model (``holding_the_model``) and, once they are all in the
    batcher's queue behind it, one request per value of ``queued``."""
    from conftest import eventually

    running = await holding_the_model(probe, client, held)
    waiting = [asyncio.create_task(client.post("/v1/predict", json=rows(value)))
               for value in queued]
    await eventually(lambda: app.state.serve.batcher.depth == len(queued))
    return running, waiting


def rows(*first: float) -> dict[str, Any]:
    return {"inputs": [[value, 0.0, 0.0, 0.0] for value in first]}


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())
