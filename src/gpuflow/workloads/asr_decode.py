"""CTC decoding: greedy, and a prefix beam search that a lexicon (or, later, a word-level
language model) can constrain; word and character error rates.

The beam scores each prefix by its best alignment (the Viterbi approximation), not by the
sum over its alignments. The unconstrained best prefix is then the frame-by-frame argmax,
which greedy decoding finds, so a beam of any width without a lexicon returns greedy's
answer (width 1 in particular), and the beam's worth lies where it is constrained: with the
lexicon it returns the best alignment whose words are all in it (e.g. "seven" when greedy
heard "seve"), and a language model's word scores would add to the same alignment scores.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jiwer
import torch

from gpuflow.workloads.asr_text import Vocabulary, normalise

Prefix = tuple[int, ...]
NEG_INF = float("-inf")


def greedy(log_probs: torch.Tensor, frames: int) -> list[int]:
    """The most probable label of each frame, repeats merged, blanks (0) removed."""
    best = log_probs[:frames].argmax(dim=-1).tolist()
    return [label for i, label in enumerate(best) if label != 0 and
            (i == 0 or label != best[i - 1])]


class Lexicon:
    """The words a transcript may hold, as prefixes of character ids."""

    def __init__(self, words: Iterable[str], vocabulary: Vocabulary) -> None:
        if " " not in vocabulary.index:
            raise ValueError("a lexicon needs a vocabulary with a space between words")
        self.space = vocabulary.index[" "]
        self.words = {tuple(vocabulary.encode(w)) for w in words if vocabulary.encode(w)}
        self.prefixes = {word[:n] for word in self.words for n in range(len(word) + 1)}

    def partial(self, prefix: Prefix) -> Prefix:
        """The word ``prefix`` ends in (empty right after a space)."""
        for i in range(len(prefix) - 1, -1, -1):
            if prefix[i] == self.space:
                return prefix[i + 1:]
        return prefix

    def allows(self, prefix: Prefix, label: int) -> bool:
        """Whether ``prefix + label`` can still become a sequence of lexicon words."""
        partial = self.partial(prefix)
        if label == self.space:
            return partial in self.words
        return (*partial, label) in self.prefixes

    def complete(self, prefix: Prefix) -> bool:
        partial = self.partial(prefix)
        return not partial or partial in self.words


def beam_search(log_probs: torch.Tensor, frames: int, width: int,
                lexicon: Lexicon | None = None, prune: float = 12.0) -> list[int]:
    """The best-scoring prefix found by a CTC prefix beam of ``width`` over ``frames``.

    Each prefix keeps its best alignment's score ending in a blank and ending in its last
    label; a label that repeats the last one extends the prefix only after a blank. A frame
    extends prefixes only by labels within ``prune`` nats of its most probable one.
    """
    table = log_probs[:frames].float().cpu().numpy()
    beams: dict[Prefix, list[float]] = {(): [0.0, NEG_INF]}
    for row in table:
        grown: dict[Prefix, list[float]] = {}
        likely = [label for label in range(1, len(row)) if row[label] > row.max() - prune]
        for prefix, (blank, label_end) in beams.items():
            best = max(blank, label_end)
            _keep(grown, prefix, 0, best + row[0])
            last = prefix[-1] if prefix else None
            if last is not None:
                _keep(grown, prefix, 1, label_end + row[last])
            for label in likely:
                if lexicon is not None and not lexicon.allows(prefix, label):
                    continue
                start = blank if label == last else best
                _keep(grown, (*prefix, label), 1, start + row[label])
        beams = dict(sorted(grown.items(), key=lambda item: -max(item[1]))[:width])
    finished = [(max(scores), prefix) for prefix, scores in beams.items()
                if lexicon is None or lexicon.complete(prefix)]
    if not finished:
        return []
    return list(max(finished)[1])


def _keep(beams: dict[Prefix, list[float]], prefix: Prefix, end: int, score: float) -> None:
    scores = beams.setdefault(prefix, [NEG_INF, NEG_INF])
    scores[end] = max(scores[end], score)


def decode_batch(logits: torch.Tensor, frames: torch.Tensor, vocabulary: Vocabulary,
                 width: int = 1, lexicon: Lexicon | None = None) -> list[str]:
    """Transcripts of a batch of logits ``(B, T, V)``: greedy at width 1 without a lexicon,
    else the beam."""
    log_probs = torch.log_softmax(logits.detach().float(), dim=-1).cpu()
    texts = []
    for row, count in zip(log_probs, frames.tolist(), strict=True):
        ids = (greedy(row, count) if width == 1 and lexicon is None
               else beam_search(row, count, width, lexicon))
        texts.append(vocabulary.decode(ids))
    return texts


def error_counts(references: Sequence[str], hypotheses: Sequence[str],
                 unit: str = "word") -> tuple[int, int]:
    """(edit errors, reference length) in words or characters, after ``normalise``: the
    parts of WER or CER, which sum over utterances before they divide."""
    refs = [normalise(text) for text in references]
    hyps = [normalise(text) for text in hypotheses]
    if unit == "word":
        kept = [(r, h) for r, h in zip(refs, hyps, strict=True) if r or h]
        if not kept:
            return 0, 0
        out = jiwer.process_words([r for r, _ in kept], [h for _, h in kept])
    else:
        out = jiwer.process_characters(refs, hyps)
    errors = out.substitutions + out.deletions + out.insertions
    return errors, out.substitutions + out.deletions + out.hits


def error_rate(references: Sequence[str], hypotheses: Sequence[str],
               unit: str = "word") -> float:
    errors, length = error_counts(references, hypotheses, unit)
    return errors / length if length else float(errors > 0)

