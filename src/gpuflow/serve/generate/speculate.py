"""Speculative decoding: tokens drafted cheaply, verified by the served model in one forward.

A decoding sequence's step computes its last token and up to ``k`` drafted tokens after it
(``Chunk.room`` of them, reserved by the scheduler); the model's logits at each of those
positions verify the drafts in order (``Sampler.verify``: greedy keeps a draft that is the
argmax, sampling keeps the model's distribution by rejection), and the first refused draft
is replaced by the model's own choice, so a step yields from one to ``k + 1`` tokens and the
text is what decoding one token a step would give (greedy: the same tokens).

Drafts come from a ``Proposer``: ``PromptLookup`` (prompt lookup, or n-gram drafting) finds
the sequence's last few tokens earlier in its prompt or output and drafts what followed
them there, at no model cost, which pays where replies repeat their context (code edits,
quoting, extraction); ``DraftModel`` (``draft.py``) asks a smaller model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from gpuflow.serve.generate.sampling import Sampler
from gpuflow.serve.generate.scheduler import Chunk, Sequence


@dataclass(frozen=True)
class Draft:
    """Drafted tokens, and the distributions they were drawn from (``[k, V]``; None when
    each was certain, as prompt lookup's are, or the request is greedy)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Drafts tokens for a step's decoding sequences."""

    def propose(self, chunks: list[Chunk], rooms: Mapping[Sequence, int],
                samplers: Mapping[Sequence, Sampler]) -> dict[Sequence, Draft]:
        """Drafts of at most ``rooms[seq]`` tokens for the sequences in ``rooms``;
        ``chunks`` is the whole step (a draft model computes what the model does)."""
        ...

    def settle(self, chunks: list[Chunk]) -> None:
        """The step ran and its drafts were verified (``seq.num_computed`` is final)."""
        ...


class PromptLookup:
    """Drafts what followed the latest earlier occurrence of a sequence's last ``n`` tokens,
    ``n`` from ``max_ngram`` down to ``min_ngram`` (the longest match first)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, chunks: list[Chunk], rooms: Mapping[Sequence, int],
                samplers: Mapping[Sequence, Sampler]) -> dict[Sequence, Draft]:
        drafts = {}
        for seq, room in rooms.items():
            tokens = lookup(seq.tokens, room, self.max_ngram, self.min_ngram)
            if tokens:
                drafts[seq] = Draft(tokens)
        return drafts

    def settle(self, chunks: list[Chunk]) -> None:
        pass


def lookup(tokens: list[int], count: int, max_ngram: int, min_ngram: int) -> list[int]:
    """``count`` tokens that followed the latest earlier occurrence of the last ``n`` of
    ``tokens`` (``n`` from ``max_ngram`` down to ``min_ngram``), or none. A match ``d``
    tokens back is followed by a copy ``d`` tokens back, the draft included where it runs
    past the end (as an LZ77 copy overlaps itself): a loop of period ``d`` is drafted in
    full, not ``d`` tokens at a time."""
    if count < 1 or len(tokens) < min_ngram + 1:
        return []
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        # Windows starting before the last n-gram's own start: every earlier occurrence.
        windows = np.lib.stride_tricks.sliding_window_view(array[:-1], n)
        starts = np.flatnonzero((windows == array[-n:]).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            draft = array[follow:follow + count].tolist()
            back = len(tokens) - follow
            while len(draft) < count:
                draft.append(draft[len(draft) - back])
            return draft
    return []


def verified(sampler: Sampler, logits: torch.Tensor, draft: Draft) -> Iterator[int]:
    """The tokens a sequence takes from one verifying forward (``logits[k + 1, V]``, the
    model's at its last token and at each drafted one): the drafts it accepts, in order,
    then its own choice after the last accepted. A generator: the caller takes each token
    (its penalties count it) before the next is verified, and stops early when the
    sequence finishes."""
    for position, drafted in enumerate(draft.tokens):
        probs = None if draft.probs is None else draft.probs[position]
        token = sampler.verify(logits[position], drafted, probs)
        yield token
        if token != drafted:
            return
    yield sampler.choose(logits[len(draft.tokens)])
