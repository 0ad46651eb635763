"""Constrained decoding (structured outputs) through llguidance: a request's grammar (a JSON
schema, a regex, a choice of strings, a Lark or GBNF grammar), compiled against the model's
vocabulary, masks each step's logits of the row it constrains to the tokens the grammar
allows next.

What crosses to the engine core is text (``Constraint``: llguidance's grammar) and, once,
the vocabulary as bytes (``Vocabulary``): both pickle. The server compiles a grammar to
refuse a bad one with a 400 before it queues; the core compiles it again for its rows.
Each side caches compiled grammars by their text (``Grammars``), and each row steps a copy
(``Guide``)."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from gpuflow.serve.generate.tokenizer import Tokenizer

# JSON as OpenAI's structured outputs write it: no whitespace between tokens, so that a
# random or small model cannot pad a value with spaces until max_tokens.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
CACHED_GRAMMARS = 256


class GrammarError(ValueError):
    """A grammar llguidance cannot compile; the message says why (e.g. the keyword)."""


@dataclass(frozen=True)
class Constraint:
    """A request's grammar, as llguidance's JSON grammar text (``LLMatcher.grammar_from_*``)."""

    grammar: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Constraint:
        return cls(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls(LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        return cls(LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(option) for option in options)))

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """A Lark grammar (llguidance's dialect), or a GBNF one (llama.cpp's), converted."""
        try:
            return cls(LLMatcher.grammar_from_lark(any_to_lark(grammar)))
        except Exception as exc:  # the GBNF converter's own errors
            raise GrammarError(str(exc)) from None


@dataclass(frozen=True)
class Vocabulary:
    """Each token id's bytes and the special ids (never part of a constrained text): what
    llguidance reads of a tokenizer, as data that pickles to the core."""

    tokens: tuple[bytes, ...]
    special: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Tokenizer, size: int) -> Vocabulary:
        """The first ``size`` ids (the model's logits; ids past the tokenizer's are empty)."""
        known = min(size, tokenizer.vocab_size)
        tokens = [tokenizer.token_bytes(i) for i in range(known)] + [b""] * (size - known)
        return cls(tuple(tokens), tuple(sorted(i for i in tokenizer.special if i < size)))


class _TokenTable:
    """llguidance's ``TokenizerWrapper`` protocol over a ``Vocabulary``; it encodes text
    (which llguidance seldom asks of it) by longest match, having no tokenizer here."""

    is_tokenizer_wrapper = True
    bos_token_id = None

    def __init__(self, vocabulary: Vocabulary, eos: int) -> None:
        self.tokens = list(vocabulary.tokens)
        self.special_token_ids = list(vocabulary.special)
        self.eos_token_id = eos
        special = set(vocabulary.special)
        self._ids = {t: i for i, t in enumerate(self.tokens) if t and i not in special}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        ids, at = [], 0
        while at < len(data):
            for end in range(min(len(data), at + self._longest), at, -1):
                if data[at:end] in self._ids:
                    ids.append(self._ids[data[at:end]])
                    at = end
                    break
            else:
                at += 1  # a byte no token holds: left out
        return ids


class Guide:
    """One row's grammar state: which tokens may come next, and whether it is complete."""

    def __init__(self, matcher: LLMatcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.mask_s = 0.0  # seconds spent computing masks since the last read
        self._forbidden: torch.Tensor | None = None  # the next token's, once prepared

    def prepare(self) -> None:
        """Compute the next token's mask now: the core does it while the step's forward
        runs, ``masked`` then only applies it."""
        started = time.perf_counter()
        # llguidance's bitmask: token i is bit i % 32 of 32-bit word i // 32, little-endian.
        bits = numpy.frombuffer(self.matcher.compute_bitmask(), dtype=numpy.uint8)
        allowed = numpy.unpackbits(bits, count=self.vocab_size, bitorder="little")
        self._forbidden = torch.from_numpy(allowed) == 0
        self.mask_s += time.perf_counter() - started

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits[V]`` (on the host) with every token the grammar forbids at -inf."""
        if self._forbidden is None:
            self.prepare()
        assert self._forbidden is not None
        started = time.perf_counter()
        masked = logits.masked_fill(self._forbidden, float("-inf"))
        self._forbidden = None
        self.mask_s += time.perf_counter() - started
        return masked

    def spent(self) -> float:
        """Seconds its masks took since the last call."""
        seconds, self.mask_s = self.mask_s, 0.0
        return seconds

    def accepted(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (drafts) the grammar takes in order from here, its state
        left as it is."""
        return int(self.matcher.validate_tokens(tokens))

    def advance(self, token: int) -> None:
        self._forbidden = None
        self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more: the text is whole, the row ends ("stop")."""
        return self.matcher.is_stopped()


class Grammars:
    """Grammars compiled against one vocabulary, the latest ``CACHED_GRAMMARS`` kept by
    their text; ``eos_ids`` are what a complete text may end with. Safe to share between
    threads."""

    def __init__(self, vocabulary: Vocabulary, eos_ids: Iterable[int] = ()) -> None:
        self.vocabulary = vocabulary
        size = len(vocabulary.tokens)
        ends = sorted(eos_ids)
        # Without an end-of-sequence id the grammar's end is an id past the logits: a
        # row ends when its grammar allows nothing more, or at max_tokens.
        if not ends:
            vocabulary = Vocabulary((*vocabulary.tokens, b""), vocabulary.special)
            ends = [size]
        self.vocab_size = size
        self.tokenizer = LLTokenizer(_TokenTable(vocabulary, ends[0]),  # type: ignore[arg-type]
                                     n_vocab=len(vocabulary.tokens), eos_token=ends)
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the cache's; a compile runs outside it

    def is_cached(self, constraint: Constraint) -> bool:
        with self._lock:
            return constraint.grammar in self._compiled

    def compile(self, constraint: Constraint) -> LLMatcher:
        """The grammar's matcher at its start (cached); raises ``GrammarError``."""
        with self._lock:
            matcher = self._compiled.get(constraint.grammar)
            if matcher is not None:
                self._compiled.move_to_end(constraint.grammar)
                return matcher
        matcher = LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._compiled[constraint.grammar] = matcher
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def guide(self, constraint: Constraint) -> Guide:
        """A new row's guide: a copy of the compiled grammar at its start."""
        return Guide(self.compile(constraint).deep_copy(), self.vocab_size)
