"""Transcripts for speech recognition: one normalisation rule, and a character vocabulary.

The rule (``normalise``): Unicode NFKC, lower case, every character that is not a letter, a
digit or an apostrophe becomes a space, and runs of spaces become one, trimmed. Case and
punctuation are not heard, so a model should not be asked to guess them, and references and
hypotheses scored by WER pass through the same rule.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence

BLANK = "<blank>"
_NOT_SPOKEN = re.compile(r"[^\w']|_", re.UNICODE)
_SPACES = re.compile(r"\s+")


def normalise(text: str) -> str:
    """``text`` as the model hears it: see the module's rule."""
    text = unicodedata.normalize("NFKC", text).lower()
    return _SPACES.sub(" ", _NOT_SPOKEN.sub(" ", text)).strip()


class Vocabulary:
    """Characters of the normalised training text, CTC's blank at index 0."""

    def __init__(self, symbols: Sequence[str]) -> None:
        if not symbols or symbols[0] != BLANK:
            raise ValueError(f"a vocabulary starts with {BLANK!r}")
        self.symbols = list(symbols)
        self.index = {symbol: i for i, symbol in enumerate(self.symbols)}

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> Vocabulary:
        return cls([BLANK, *sorted({char for text in texts for char in normalise(text)})])

    def __len__(self) -> int:
        return len(self.symbols)

    def unknown(self, text: str) -> set[str]:
        """Characters of normalised ``text`` the vocabulary lacks."""
        return {char for char in normalise(text) if char not in self.index}

    def encode(self, text: str) -> list[int]:
        """Ids of normalised ``text``; characters outside the vocabulary are left out."""
        return [self.index[char] for char in normalise(text) if char in self.index]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.symbols[i] for i in ids if i != 0)
