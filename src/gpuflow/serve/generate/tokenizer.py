"""Provisional: byte tokens for the generation engine (replaced by the tokenizer module)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    def add(self, token: int) -> str: ...
    def finish(self) -> str: ...


class Tokenizer(Protocol):
    def detokenizer(self, prompt: Sequence[int]) -> Detokenizer: ...


class _ByteDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._decoder.decode(bytes([token]))

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    vocab_size = 256

    def detokenizer(self, prompt: Sequence[int]) -> Detokenizer:
        return _ByteDetokenizer()
