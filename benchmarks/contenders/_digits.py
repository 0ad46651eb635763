"""What every contender server shares with `gpuflow serve`: gpuflow's own model loading,
codec (request JSON -> normalised tensor rows, batch -> softmax, top-k answer) and answer
JSON, so that only the serving machinery differs between the servers compared."""

from __future__ import annotations

import time
from typing import Any

import torch

from gpuflow.serve.engine import Engine, EngineOptions
from gpuflow.serving import Decoded, InputError, PredictRequest

__all__ = ["InputError", "PredictRequest", "answer", "load_engine", "run_rows"]


def load_engine(source: str, max_batch_size: int, threads: int) -> Engine:
    """The export loaded exactly as `gpuflow serve --device cpu` loads it, warmed up."""
    torch.set_num_threads(threads)
    engine = Engine.load(source, EngineOptions(device="cpu", max_batch_size=max_batch_size))
    engine.warm_up()
    return engine


def run_rows(engine: Engine, decoded: list[Decoded]) -> tuple[list[list[Any]], float, int]:
    """The requests' rows as one batch (per batching key); each request's outputs, the
    seconds the batch took and its rows."""
    start = time.monotonic()
    outputs: list[list[Any]] = [[] for _ in decoded]
    rows = 0
    for key in dict.fromkeys(d.key for d in decoded):
        members = [i for i, d in enumerate(decoded) if d.key == key]
        batch = [row for i in members for row in decoded[i].rows]
        rows += len(batch)
        results = engine.run(key, batch)
        offset = 0
        for i in members:
            count = len(decoded[i].rows)
            outputs[i] = results[offset:offset + count]
            offset += count
    return outputs, time.monotonic() - start, rows


def answer(engine: Engine, request: PredictRequest, outputs: list[Any], compute_s: float,
           batch_rows: int, queue_s: float | None) -> dict[str, Any]:
    """The body `gpuflow serve` answers /v1/predict with."""
    return {
        "predictions": [engine.codec.format(out, request) for out in outputs],
        "queue_ms": None if queue_s is None else round(queue_s * 1000, 3),
        "compute_ms": round(compute_s * 1000, 3),
        "batch_rows": batch_rows,
        "model": {"workload": engine.loaded.workload.name, "step": engine.loaded.step},
    }

