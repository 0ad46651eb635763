"""How the engine's model runs one scheduled step over the paged KV pool.

A step with prompt chunks (or any step, unbucketed) is one ``StepBatch`` through the
model's ``forward``: decode rows and prefill chunks of several sequences in one forward.
A step of decode rows alone, over buckets (``bucketed``; always so when compiled), is the
model's static-shape ``decode_step``, its rows padded up to the next bucket size (the
predict path's ``batch_buckets`` of ``max_num_seqs``) with rows that write into the null
block and whose logits are dropped, every block table padded to the context's width.
``compile`` runs that step through ``torch.compile(dynamic=False)``, one graph per bucket,
and ``cuda_graphs`` (CUDA only) with ``mode="reduce-overhead"``, which replays each
bucket's step as a CUDA graph. ``warm_up`` runs every bucket before the server is ready,
in the engine's thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gpuflow.graph_threads import prepare_thread_for_cuda_graphs
from gpuflow.serve.generate.blocks import blocks_for
from gpuflow.serve.generate.lora_slots import NO_ADAPTER
from gpuflow.serve.generate.paged import NULL_BLOCK, KVPool, PagedLM, RowSpec, StepBatch
from gpuflow.serve.model import allow_compiled_shapes, batch_buckets

log = logging.getLogger("gpuflow.serve")
# One-token rows of a step whose token is still on the device, and those tokens.
Patch = tuple[list[int], torch.Tensor]


def compile_mode(cuda_graphs: bool, max_autotune: bool) -> str | None:
    """``torch.compile``'s mode for the decode step: ``reduce-overhead`` replays CUDA
    graphs; ``max-autotune`` measures kernel choices for each matrix product at compile
    time (on the CPU over weights frozen while compiling: ``ModelRunner.warm_up``)."""
    if max_autotune:
        return "max-autotune" if cuda_graphs else "max-autotune-no-cudagraphs"
    return "reduce-overhead" if cuda_graphs else None


class ModelRunner:
    """The model's KV pool and forwards, as the engine's thread calls them."""

    def __init__(self, lm: PagedLM, num_blocks: int, block_size: int, max_num_seqs: int,
                 bucketed: bool = False, compile: bool = False,
                 cuda_graphs: bool = False, max_autotune: bool = False) -> None:
        self.lm, self.block_size = lm, block_size
        self.pool: KVPool = lm.new_pool(num_blocks, block_size)
        self.max_blocks = blocks_for(lm.context, block_size)  # a whole context's block table
        self.compiled = compile or cuda_graphs or max_autotune
        self.max_autotune = max_autotune
        self.buckets = batch_buckets(max_num_seqs) if bucketed or self.compiled else None
        # As the predict path's Runner: no CUDA graphs off CUDA (describe() says so).
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.model_step = self._compiled_step()
        self.compile_failure: str | None = None
        self.graphs_skipped = False
        self.graphed = False  # the last step replayed a CUDA graph
        self.warmup_s: float | None = None

    @property
    def device(self) -> torch.device:
        return self.pool.keys.device

    def describe(self) -> str:
        """How decode steps run, e.g. ``decode compiled for batch buckets 1,2,4``."""
        if self.buckets is None:
            return "decode eager, one row per running sequence"
        sizes = ",".join(map(str, self.buckets))
        if not self.compiled:
            return f"decode eager over batch buckets {sizes}"
        if self.compile_failure is not None:
            return (f"decode eager over batch buckets {sizes}: torch.compile failed "
                    f"({self.compile_failure})")
        graphs = ""
        if self.cuda_graphs:
            graphs = (" with CUDA graphs" if not self.graphs_skipped else
                      " with CUDA graphs, some skipped by torch.compile (see the log)")
        tuned = ", max-autotune" if self.max_autotune else ""
        return f"decode compiled for batch buckets {sizes}{graphs}{tuned}"

    def _compiled_step(self) -> Callable[..., torch.Tensor]:
        """The decode step over buckets: the model's static-shape step, compiled or not."""
        if not self.compiled:
            return self.lm.decode_step
        # The step writes the new keys and values into the pool, a graph input: held at a
        # fixed address (allocated once), it may be mutated inside a CUDA graph, which
        # cudagraph trees otherwise refuse (they would skip the graph).
        adapters = self.lm.adapters
        for tensor in self.lm.written(self.pool) + ([] if adapters is None
                                                    else adapters.tensors()):
            torch._dynamo.mark_static_address(tensor)
        assert self.buckets is not None
        allow_compiled_shapes(len(self.buckets))  # one graph per bucket, none eager
        return torch.compile(self.lm.decode_step,  # type: ignore[return-value]
                             mode=compile_mode(self.cuda_graphs, self.max_autotune),
                             dynamic=False)

    def warm_up(self) -> None:
        """Every bucket's decode step, all rows padding: compiled, and on CUDA with graphs
        warmed up, recorded and replayed once (cudagraph trees record a function on its
        second call). In the thread that serves them: cudagraph trees keep their graphs per
        thread. A compile that fails falls back to the eager step, saying so."""
        start = time.perf_counter()
        if self.cuda_graphs:
            prepare_thread_for_cuda_graphs()
        skips = self._graph_skips() if self.cuda_graphs else 0
        # Inductor's tuned C++ matrix products on the CPU take constant weights: frozen
        # into the graphs compiled here (the served model's weights never change). Only
        # then is inductor's config imported (1.2 s): an eager engine never needs it.
        freezing = (torch._inductor.config.patch(freezing=True)
                    if self.max_autotune and self.device.type == "cpu"
                    else contextlib.nullcontext())
        with freezing:
            self._warm_buckets()
        if self.cuda_graphs and self._graph_skips() > skips:
            # Inductor runs a graph it cannot capture (an op on the CPU, a mutated input
            # that is not static) without CUDA graphs, saying so only in its log.
            self.graphs_skipped = True
            log.warning("gpuflow serve: torch.compile did not capture every decode step as "
                        "a CUDA graph (torch's log says why); those steps run without")
        self.warmup_s = time.perf_counter() - start

    def _warm_buckets(self) -> None:
        """Each bucket's step, run as cudagraph trees record it (on its second call); a
        compile that fails falls back to the eager step for every bucket."""
        for size in self.buckets or []:
            for _ in range(3 if self.cuda_graphs else 1):
                try:
                    self._decode_padded([], size)
                except Exception as exc:
                    if not self.compiled or self.compile_failure is not None:
                        raise
                    self.compile_failure = failure_text(exc)
                    log.warning("gpuflow serve: torch.compile of the decode step failed "
                                "(%s); decoding eagerly over the same buckets",
                                self.compile_failure, exc_info=True)
                    self.model_step, self.cuda_graphs = self.lm.decode_step, False
                    self._decode_padded([], size)
                    break

    @staticmethod
    def _graph_skips() -> int:
        """Graphs inductor has declined to capture as CUDA graphs in this process."""
        from torch._dynamo.utils import counters

        return int(counters["inductor"]["cudagraph_skips"])

    def run(self, rows: Sequence[RowSpec], patch: Patch | None = None) -> list[torch.Tensor]:
        """One step over ``rows`` (one-token rows first): each row's logits as it asked
        (``[1, V]`` for its last token, ``[T, V]`` for all, ``[0, V]`` for none), on the
        model's device in its dtype, to be read before the next step (a CUDA graph's
        output); what must be read on the host goes there by ``sampling.on_host``, so a
        greedy batch moves its argmaxes, not ``B x V`` logits. ``patch``: one-token rows
        whose token is still on the device, and those tokens (``launch.py``)."""
        counts = [len(r.tokens) if r.logits == "all" else int(r.logits == "last")
                  for r in rows]
        return list(self.run_flat(rows, patch).split(counts))

    def run_flat(self, rows: Sequence[RowSpec], patch: Patch | None = None) -> torch.Tensor:
        """``run``'s logits as one tensor, the rows' in order: ``[K, V]``."""
        if self.buckets is not None and all(len(r.tokens) == 1 and r.logits == "last"
                                            for r in rows):
            size = next(b for b in self.buckets if b >= len(rows))
            self.graphed = self.cuda_graphs and not self.graphs_skipped
            return self._decode_padded(rows, size, patch)
        self.graphed = False
        batch = StepBatch.build(rows, self.block_size, self.device)
        if patch is not None:  # one-token rows lead: row i's token is token i
            batch.tokens[torch.tensor(patch[0], device=self.device)] = patch[1]
        return self.lm.forward(batch, self.pool)

    def _decode_padded(self, rows: Sequence[RowSpec], bucket: int,
                       patch: Patch | None = None) -> torch.Tensor:
        """One decode step padded to ``bucket`` rows, the padding rows (token 0 at position
        0) writing into the null block; the real rows' logits ``[B, V]``, on the device.
        With adapters, each row's adapter slot goes in too (the base's for padding)."""
        width, size = self.max_blocks, self.block_size
        adapters = self.lm.adapters is not None
        table = []
        for row in rows:
            (token,), position = row.tokens, row.start
            slot = row.blocks[position // size] * size + position % size
            table.append([token, position, slot, *([row.adapter] if adapters else []),
                          *row.blocks, *[NULL_BLOCK] * (width - len(row.blocks))])
        table += [[0, 0, NULL_BLOCK, *([NO_ADAPTER] if adapters else []),
                   *[NULL_BLOCK] * width]] * (bucket - len(rows))
        host = torch.tensor(table, dtype=torch.long)
        on_device = host.to(self.device)  # one copy to the device
        if patch is not None:
            on_device[torch.tensor(patch[0], device=self.device), 0] = patch[1]
        tokens, positions, slots = on_device[:, :3].unbind(1)
        if self.cuda_graphs:
            # A new step of cudagraph trees: the previous replay's outputs (read by the
            # engine within its step, before this replay overwrites them) may be reused. The inputs
            # are fresh tensors, which the trees copy into the graph's own.
            torch.compiler.cudagraph_mark_step_begin()
        if adapters:
            logits = self.model_step(tokens, positions, slots, on_device[:, 4:], self.pool,
                                     adapters=on_device[:, 3])
        else:
            logits = self.model_step(tokens, positions, slots, on_device[:, 3:], self.pool)
        return logits[:len(rows)]


def failure_text(exc: BaseException) -> str:
    """``Type: message`` of an exception, and where it was raised when the message is
    empty (a bare ``assert`` deep in torch says nothing else)."""
    text = f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    if str(exc) or not frames:
        return text
    return f"{text}at {Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})"
