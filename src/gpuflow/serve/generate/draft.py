"""Drafting with a smaller model (``--draft-model``): its own KV pool, addressed by the served
model's block tables, so the draft needs no block manager of its own.

The draft computes every chunk the served model computes, in the same step and before it
(so a block in the prefix cache holds both models' keys and values), then drafts each
decoding sequence's tokens one forward at a time. Where the served model accepted every
draft, the draft has not yet computed the last one: its next step starts from there (a
sequence that ends first leaves that one position missing from the draft's side of a
cached block, which only makes the draft's guesses there worse: the served model
verifies every one).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping

import torch

from gpuflow.serve.generate.paged import RowSpec
from gpuflow.serve.generate.runner import ModelRunner
from gpuflow.serve.generate.sampling import Sampler, greedy_ids, on_host
from gpuflow.serve.generate.scheduler import Chunk, Sequence
from gpuflow.serve.generate.speculate import Draft

log = logging.getLogger("gpuflow.serve")


class DraftModel:
    """Drafts tokens with the model a ``ModelRunner`` drives, over a pool of as many blocks
    as the served model's."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # Where each sequence's keys and values in the draft's pool end, and where the
        # current step's forwards leave them.
        self._computed: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self._written: dict[Sequence, int] = {}

    def propose(self, chunks: list[Chunk], rooms: Mapping[Sequence, int],
                samplers: Mapping[Sequence, Sampler]) -> dict[Sequence, Draft]:
        """Drafts; none when the draft model fails (drafting only saves time): its keys for
        the step's chunks then count as unwritten, to be caught up on the next step."""
        try:
            return self._propose(chunks, rooms, samplers)
        except Exception as exc:
            log.warning("gpuflow serve: the draft model failed (%s: %s); this step decodes "
                        "without drafts", type(exc).__name__, exc)
            for chunk in chunks:
                self._written[chunk.seq] = min(self._computed.get(chunk.seq, chunk.start),
                                               chunk.start)
            return {}

    def _propose(self, chunks: list[Chunk], rooms: Mapping[Sequence, int],
                 samplers: Mapping[Sequence, Sampler]) -> dict[Sequence, Draft]:
        tokens: dict[Sequence, list[int]] = {seq: [] for seq in rooms}
        probs: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq in rooms}
        rows = {chunk.seq: self._catch_up(chunk, chunk.seq in rooms) for chunk in chunks}
        while rows:
            ordered = sorted(rows.items(), key=lambda item: len(item[1].tokens) > 1)
            logits = self.runner.run([row for _, row in ordered])
            rows = {}
            for (seq, row), row_logits in zip(ordered, logits, strict=True):
                self._written[seq] = row.start + len(row.tokens)
                if seq not in rooms:
                    continue
                token, dist = _draw(samplers[seq], row_logits[-1])
                tokens[seq].append(token)
                if dist is not None:
                    probs[seq].append(dist)
                if len(tokens[seq]) < rooms[seq]:  # its next draft needs this one computed
                    rows[seq] = RowSpec([token], row.start + len(row.tokens),
                                        seq.table.blocks)
        return {seq: Draft(drafted, torch.stack(probs[seq]) if probs[seq] else None)
                for seq, drafted in tokens.items()}

    def _catch_up(self, chunk: Chunk, drafting: bool) -> RowSpec:
        """The draft's row for ``chunk``: its tokens, from where the draft's own keys end
        when they lag behind the served model's."""
        seq, end = chunk.seq, chunk.start + chunk.length
        start = min(self._computed.get(seq, chunk.start), chunk.start)
        return RowSpec(seq.tokens[start:end], start, seq.table.blocks,
                       "last" if drafting else "none")

    def settle(self, chunks: list[Chunk]) -> None:
        """The draft's keys are good up to where it wrote, and no further than the tokens
        the served model kept."""
        for chunk in chunks:
            written = self._written.pop(chunk.seq, chunk.start + chunk.length)
            self._computed[chunk.seq] = min(written, chunk.seq.num_computed)
        self._written.clear()


def _draw(sampler: Sampler, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """A drafted token from the draft's ``logits[V]``, and the distribution it was drawn from
    (the request's temperature, top-k and top-p), or None for a greedy request (its argmax:
    verification compares argmaxes)."""
    if sampler.params.temperature == 0.0:
        return int(greedy_ids(logits)), None
    dist = sampler.probabilities(on_host(logits))
    return int(torch.multinomial(dist, 1, generator=sampler.generator)), dist
