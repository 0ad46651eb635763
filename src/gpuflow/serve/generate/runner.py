"""How the engine's model runs: the KV cache, prefill forwards, and decode steps eagerly over
exactly the active rows, or over fixed batch buckets, eager, compiled or replayed as CUDA
graphs.

Over buckets (``bucketed``; always so when compiled) the active rows are padded up to the
next bucket size, the predict path's ``batch_buckets`` of the slot count, with rows that
point at a scratch slot no request ever holds (their writes land there, their logits are
dropped), and the step is the model's static-shape one (``CachedLM.step``: the whole
context under a mask). ``compile`` runs that step through ``torch.compile(dynamic=False)``,
one graph per bucket, and ``cuda_graphs`` (CUDA only) with ``mode="reduce-overhead"``,
which replays each bucket's step as a CUDA graph. ``warm_up`` runs every bucket before
the server is ready, in the engine's thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from gpuflow.serve.model import batch_buckets

if TYPE_CHECKING:
    from gpuflow.serve.generate.engine import CachedLM

log = logging.getLogger("gpuflow.serve")


class DecodeRunner:
    """The model's cache and forwards, as the engine's thread calls them."""

    def __init__(self, lm: CachedLM, slots: int, bucketed: bool = False,
                 compile: bool = False, cuda_graphs: bool = False) -> None:
        self.lm = lm
        self.compiled = compile or cuda_graphs
        self.buckets = batch_buckets(slots) if bucketed or self.compiled else None
        # The scratch slot, one past the requests' slots, takes the padding rows' writes.
        self.scratch = slots
        self.cache = lm.new_cache(slots + 1 if self.buckets else slots)
        # As the predict path's Runner: no CUDA graphs off CUDA (describe() says so).
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.model_step = self._compiled_step()
        self.compile_failure: str | None = None
        self.graphs_skipped = False
        self.warmup_s: float | None = None

    @property
    def device(self) -> torch.device:
        return self.cache.keys.device

    def describe(self) -> str:
        """How decode steps run, e.g. ``decode compiled for batch buckets 1,2,4``."""
        if self.buckets is None:
            return "decode eager, one row per active sequence"
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
        return f"decode compiled for batch buckets {sizes}{graphs}"

    def _compiled_step(self) -> Callable[..., torch.Tensor]:
        """The decode step over buckets: the model's static-shape step, compiled or not."""
        if not self.compiled:
            return self.lm.step
        # The step writes the new keys and values into the cache, a graph input: held at
        # a fixed address (allocated once), it may be mutated inside a CUDA graph, which
        # cudagraph trees otherwise refuse (they would skip the graph).
        for tensor in self.lm.written(self.cache):
            torch._dynamo.mark_static_address(tensor)
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        assert self.buckets is not None
        if getattr(config, name) < len(self.buckets):  # one graph per bucket, none eager
            setattr(config, name, len(self.buckets))
        mode = "reduce-overhead" if self.cuda_graphs else None
        return torch.compile(self.lm.step, mode=mode, dynamic=False)  # type: ignore[return-value]

    def warm_up(self) -> None:
        """Every bucket's decode step, all rows in the scratch slot: compiled, and on CUDA
        with graphs warmed up, recorded and replayed once (cudagraph trees record a
        function on its second call). In the thread that serves them: cudagraph trees
        keep their graphs per thread. A compile that fails falls back to the eager step,
        saying so."""
        start = time.perf_counter()
        skips = self._graph_skips()
        for size in self.buckets or []:
            for _ in range(3 if self.cuda_graphs else 1):
                try:
                    self._padded([], [], [], size)
                except Exception as exc:
                    if not self.compiled or self.compile_failure is not None:
                        raise
                    self.compile_failure = f"{type(exc).__name__}: {exc}"
                    log.warning("gpuflow serve: torch.compile of the decode step failed "
                                "(%s); decoding eagerly over the same buckets",
                                self.compile_failure)
                    self.model_step, self.cuda_graphs = self.lm.step, False
                    self._padded([], [], [], size)
                    break
        if self.cuda_graphs and self._graph_skips() > skips:
            # Inductor runs a graph it cannot capture (an op on the CPU, a mutated input
            # that is not static) without CUDA graphs, saying so only in its log.
            self.graphs_skipped = True
            log.warning("gpuflow serve: torch.compile did not capture every decode step as "
                        "a CUDA graph (torch's log says why); those steps run without")
        self.warmup_s = time.perf_counter() - start

    @staticmethod
    def _graph_skips() -> int:
        """Graphs inductor has declined to capture as CUDA graphs in this process."""
        from torch._dynamo.utils import counters

        return int(counters["inductor"]["cudagraph_skips"])

    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                all_positions: bool = False) -> torch.Tensor:
        """Prompts, right-padded, into their slots: the logits of each one's last token
        (``[B, V]``), or of every position of a lone prompt (``[1, T, V]``); on the CPU,
        in fp32."""
        longest = max(len(prompt) for prompt in prompts)
        tokens = torch.zeros(len(prompts), longest, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = torch.tensor(prompt)
        lengths = torch.tensor([len(prompt) for prompt in prompts])
        logits = self.lm.logits(tokens.to(self.device), self.cache,
                                torch.tensor(slots, device=self.device),
                                torch.zeros_like(lengths, device=self.device),
                                None if all_positions else lengths.to(self.device),
                                all_positions=all_positions)
        return logits.float().cpu()

    def decode(self, tokens: Sequence[int], slots: Sequence[int],
               starts: Sequence[int]) -> torch.Tensor:
        """One decode step: ``tokens[b]`` at position ``starts[b]`` of slot ``slots[b]``;
        the logits ``[B, V]``, on the CPU, in fp32."""
        if self.buckets is not None:
            size = next(b for b in self.buckets if b >= len(tokens))
            return self._padded(tokens, slots, starts, size)
        rows = torch.tensor([list(tokens), list(slots), list(starts)]).to(self.device)
        logits = self.lm.logits(rows[0][:, None], self.cache, rows[1], rows[2])
        return logits.float().cpu()

    def _padded(self, tokens: Sequence[int], slots: Sequence[int], starts: Sequence[int],
                size: int) -> torch.Tensor:
        """One decode step padded to ``size`` rows, the padding rows (token 0 at position
        0) in the scratch slot; the real rows' logits, on the CPU."""
        pad = size - len(tokens)
        rows = torch.tensor([[*tokens, *[0] * pad], [*slots, *[self.scratch] * pad],
                             [*starts, *[0] * pad]])
        tokens_, slots_, starts_ = rows.to(self.device).unbind(0)  # one copy to the device
        if self.cuda_graphs:
            # A new step of cudagraph trees: the previous replay's outputs (copied to the
            # CPU below, before this replay overwrites them) may be reused. The inputs
            # are fresh tensors, which the trees copy into the graph's own.
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.model_step(tokens_[:, None], self.cache, slots_, starts_)
        return logits[:len(tokens)].float().cpu()
