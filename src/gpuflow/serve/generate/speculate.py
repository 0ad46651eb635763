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

import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

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
    ``n`` from ``max_ngram`` down to ``min_ngram`` (the longest match first), from an
    ``NgramIndex`` of each sequence kept while the sequence lives."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._indexes: weakref.WeakKeyDictionary[Sequence, NgramIndex] = (
            weakref.WeakKeyDictionary())

    def propose(self, chunks: list[Chunk], rooms: Mapping[Sequence, int],
                samplers: Mapping[Sequence, Sampler]) -> dict[Sequence, Draft]:
        drafts = {}
        for seq, room in rooms.items():
            index = self._indexes.get(seq)
            if index is None:
                index = self._indexes[seq] = NgramIndex(self.max_ngram, self.min_ngram)
            tokens = index.draft(seq.tokens, room)
            if tokens:
                drafts[seq] = Draft(tokens)
        return drafts

    def settle(self, chunks: list[Chunk]) -> None:
        pass


class NgramIndex:
    """Where each n-gram of one growing token list last began, for ``n`` from ``min_ngram``
    to ``max_ngram``: brought up to date with the tokens appended since the last call, so a
    draft costs ``O(max_ngram)`` per new token rather than a scan of the whole context. A
    long prompt is indexed ``budget`` tokens a call (1-3 µs a token for three sizes),
    drafting nothing until caught up, so that no step stalls on it."""

    def __init__(self, max_ngram: int, min_ngram: int, budget: int = 1024) -> None:
        self.sizes = range(max_ngram, min_ngram - 1, -1)  # the longest match first
        self.budget = budget
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.length = 0  # how many of the tokens are indexed

    def update(self, tokens: list[int]) -> bool:
        """Index up to ``budget`` more of ``tokens`` (the n-grams that end before the last
        indexed token: those a match may be); whether the index has caught up. A list
        shorter than the one indexed is indexed afresh."""
        if len(tokens) < self.length:
            self.latest, self.length = {n: {} for n in self.sizes}, 0
        length = min(len(tokens), self.length + self.budget)
        for n, latest in self.latest.items():
            first, end = max(self.length - n, 0), length - n  # new starts: [first, end)
            if end > first:
                grams = zip(*(tokens[first + offset:end + offset] for offset in range(n)),
                            strict=True)
                latest.update(zip(grams, range(first, end), strict=True))  # later starts win
        self.length = length
        return length == len(tokens)

    def draft(self, tokens: list[int], count: int) -> list[int]:
        """``count`` tokens that followed the latest earlier occurrence of the last ``n`` of
        ``tokens``, or none (also while the index catches up). A match ``d`` tokens back is
        followed by a copy ``d`` tokens back, the draft included where it runs past the end
        (as an LZ77 copy overlaps itself): a loop of period ``d`` is drafted in full, not
        ``d`` tokens at a time."""
        if not self.update(tokens) or count < 1:
            return []
        for n in self.sizes:
            start = self.latest[n].get(tuple(tokens[-n:])) if n < len(tokens) else None
            if start is not None:
                follow = start + n
                draft = tokens[follow:follow + count]
                back = len(tokens) - follow
                while len(draft) < count:
                    draft.append(draft[len(draft) - back])
                return draft
        return []


def lookup(tokens: list[int], count: int, max_ngram: int, min_ngram: int) -> list[int]:
    """``NgramIndex.draft`` of ``tokens`` indexed afresh, whole."""
    return NgramIndex(max_ngram, min_ngram, budget=len(tokens)).draft(tokens, count)


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
