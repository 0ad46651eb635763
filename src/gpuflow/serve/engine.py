"""The model, its codec and its runner together: what the server and offline predict share."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflow.serve.model import (
    LoadedModel,
    Runner,
    allow_compiled_shapes,
    batch_buckets,
    load_model,
)
from gpuflow.serving import Codec, key_kind
from gpuflow.workload import make_codec


@dataclass(frozen=True)
class EngineOptions:
    device: str = "auto"
    precision: str = "fp32"
    compile: bool = False
    cuda_graphs: bool = False
    max_batch_size: int = 32
    quantize: str | None = None  # "int8": the linear weights, through torchao
    dtype: str = "auto"  # the weights' (serve/dtypes.py)


class Engine:
    """Runs batches of decoded rows, padded to fixed batch buckets when shapes must be static."""

    def __init__(self, loaded: LoadedModel, options: EngineOptions) -> None:
        self.loaded = loaded
        self.options = options
        self.codec: Codec = make_codec(loaded.workload, loaded.serving_state)
        self.runner = Runner(loaded.model, options.device, options.precision,
                             options.compile, options.cuda_graphs, options.quantize,
                             options.dtype)
        self.buckets = batch_buckets(options.max_batch_size)

    @classmethod
    def load(cls, source: str | Path, options: EngineOptions, workload: str | None = None,
             name: str | None = None, max_model_len: int | None = None) -> Engine:
        return cls(load_model(source, workload, name, max_model_len), options)

    def describe(self) -> dict[str, Any]:
        return {"workload": self.loaded.workload.name, "step": self.loaded.step,
                "source": str(self.loaded.source), "inputs": list(self.codec.accepted()),
                "runs_on": self.runner.describe()}

    def run(self, key: Hashable, rows: list[Any]) -> list[Any]:
        """Outputs for ``rows``, in chunks of at most the maximum batch size; a static-shape
        model gets each chunk padded to its batch bucket."""
        limit = self.options.max_batch_size
        outputs: list[Any] = []
        for start in range(0, len(rows), limit):
            chunk = rows[start:start + limit]
            count = len(chunk)
            if self.runner.static_shapes:
                size = next(b for b in self.buckets if b >= count)
                chunk = chunk + [chunk[-1]] * (size - count)
            outputs += self.codec.run(self.runner, key, chunk)[:count]
        return outputs

    def warmup_batches(self) -> list[tuple[Hashable, list[Any]]]:
        """The batches warm-up runs, by how the runner meets shapes.

        A static-shape runner (``--compile``, CUDA graphs) compiles a graph per input shape,
        and a shape first met while serving would stall its batch for the whole compile:
        every (batching key, batch bucket) is run. An eager runner compiles nothing per
        shape; one small batch per kind of key pays the first-call costs (kernel selection,
        allocator, lazy initialisation), so a sequence model with a 2,048-token context is
        not run at every padded length times every batch size before it is ready.
        """
        rows = self.codec.warmup_rows()
        if self.runner.static_shapes:
            return [(key, [row] * size) for key, row in rows for size in self.buckets]
        smallest: dict[Hashable, tuple[Hashable, Any]] = {}
        for key, row in rows:
            smallest.setdefault(key_kind(key), (key, row))
        return [(key, [row]) for key, row in smallest.values()]

    def warm_up(self) -> float:
        """Run the warm-up batches (``warmup_batches``); seconds taken."""
        start = time.perf_counter()
        batches = self.warmup_batches()
        if self.runner.compiled:  # a graph per warmed shape, none left to run eagerly
            allow_compiled_shapes(len(batches))
        for key, batch in batches:
            self.codec.run(self.runner, key, batch)
        return time.perf_counter() - start
