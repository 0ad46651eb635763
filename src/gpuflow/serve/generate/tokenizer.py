"""Text to token ids and back for the generation engine, for any Hugging Face tokenizer and
for gpuflow's byte-level models (token ``i`` is byte ``i``).

Streamed text is detokenized incrementally: each new token decodes a short window of the
sequence (the prefix/read offsets scheme), so no token costs a decode of the whole
sequence, and the text sent so far equals ``decode(prompt + generated)`` past the prompt's
own text (whenever that decode starts with the prompt's text). Text is held back while it
ends in U+FFFD (a character whose bytes span several tokens, as byte-level BPE and
byte-fallback vocabularies split emoji and CJK), and the window starts a few tokens back
in the prompt, so that a metaspace decoder, which drops the leading space of whatever it
decodes first, keeps the space before the first generated word. Special tokens never reach
the text (``skip_special_tokens``).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

from gpuflow.byte_vocab import BYTE_VOCAB_SIZE
from gpuflow.model_dir import load_hf_tokenizer

CONTEXT = 5  # prompt tokens decoded before the first generated one
MAX_HOLD = 16  # tokens held back at most: more are no one character but invalid bytes
REPLACEMENT = "\ufffd"
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token
METASPACE = "\u2581"  # "▁", SentencePiece's stand-in for a space


class ChatTemplateError(ValueError):
    """The chat template refused the messages (e.g. roles out of order); the message is the
    template's own."""


class NoChatTemplate(ValueError):
    """The model has no chat template and none was given."""


class Detokenizer:
    """One sequence's generated tokens to text, incrementally: ``add`` returns the text that
    is safe to send now, ``finish`` the rest at the end."""

    def __init__(self, decode: Callable[[Sequence[int]], str], skip: Container[int],
                 prompt: Sequence[int], joins: bool = False) -> None:
        self._decode, self._skip, self._joins = decode, skip, joins
        # The last CONTEXT prompt tokens, and more while they start inside a character: a
        # byte-fallback decoder turns a whole run of bytes into U+FFFD if it is not UTF-8.
        ordinary = (token for token in reversed(prompt) if token not in skip)
        context = list(islice(ordinary, CONTEXT))[::-1]
        text = decode(context)
        for token in islice(ordinary, CONTEXT):
            if not text.startswith(REPLACEMENT):
                break
            context.insert(0, token)
            text = decode(context)
        # tokens[:read] are sent; tokens[prefix:read] decode to prefix_text, the base that
        # the next window's text extends.
        self._tokens = context
        self._prefix, self._read = 0, len(context)
        self._prefix_text = text

    def add(self, token: int) -> str:
        """Append a generated token; the new text that can be sent (often "")."""
        if token in self._skip:
            return ""
        self._tokens.append(token)
        text = self._decode(self._tokens[self._prefix:])
        complete = len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT)
        if not complete and len(self._tokens) - self._read < MAX_HOLD:
            return ""
        new = text[len(self._prefix_text):]
        del self._tokens[:self._read]
        self._prefix, self._read = 0, len(self._tokens)
        # The tokens sent last are the next window's base: where decodes join, they decode
        # to the text just sent (it ends on a whole character), with no second decode.
        self._prefix_text = new if complete and self._joins else self._decode(self._tokens)
        return new

    def finish(self) -> str:
        """The text of tokens still held back (e.g. an unfinished character, as U+FFFD)."""
        text = self._decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        rest, self._prefix_text = text[len(self._prefix_text):], ""
        return rest


class Tokenizer(ABC):
    """What the engine and the routes need of a tokenizer.

    ``vocab_size``: the ids it knows. ``special``: the ids its text leaves out.
    ``has_chat_template``: whether ``render_chat`` works without a template argument.
    ``decodes_join``: the decode of two lists of ids, the first ending on a whole
    character, is their decodes joined (bytes decoded as UTF-8, as a byte-level BPE's
    decoder does; not a SentencePiece decoder, which drops a decode's leading space).
    """

    vocab_size: int
    special: frozenset[int]
    has_chat_template: bool
    decodes_join: bool = False

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids, with the special tokens the tokenizer adds (e.g. BOS) if asked."""

    @abstractmethod
    def decode(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``, special tokens left out."""

    @abstractmethod
    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes (OpenAI's logprobs ``bytes``); a special token's text."""

    @abstractmethod
    def render_chat(self, messages: list[dict[str, Any]], template: str | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template (``template``, else the model's own) applied to ``messages``
        (and ``tools``, OpenAI's function definitions), with the assistant's turn opened.
        Raises ``NoChatTemplate`` when there is none and ``ChatTemplateError`` when the
        template refuses the messages."""

    def template_reads_tools(self, template: str | None = None) -> bool:
        """Whether the chat template (``template``, else the model's own) reads ``tools``:
        one that does not would drop them without a word."""
        source = self.template_source(template)
        return bool(source) and re.search(r"\btools\b", source) is not None

    def template_source(self, template: str | None = None) -> str | None:
        """The chat template's text: ``template``, else the model's own (None without)."""
        return template or self._own_template()

    def _own_template(self) -> str | None:
        return None

    def token_text(self, token: int) -> str:
        """One token's own text (OpenAI's logprobs ``token``): U+FFFD for bytes that are
        only part of a character."""
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def detokenizer(self, prompt: Sequence[int]) -> Detokenizer:
        """An incremental detokenizer for a sequence generated after ``prompt``."""
        return Detokenizer(self.decode, self.special, prompt, self.decodes_join)

    def encode_chat(self, messages: list[dict[str, Any]], template: str | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The rendered chat's ids. Templates write their own special tokens (BOS too), so
        the tokenizer adds none: no second BOS."""
        return self.encode(self.render_chat(messages, template, tools),
                           add_special_tokens=False)


class ByteTokenizer(Tokenizer):
    """gpuflow's byte-level models: token ``i`` is byte ``i`` of the UTF-8 text."""

    vocab_size = BYTE_VOCAB_SIZE
    special = frozenset()
    has_chat_template = False
    decodes_join = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([token])

    def render_chat(self, messages: list[dict[str, Any]], template: str | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if template is None:
            raise NoChatTemplate("this model has no chat template: pass one with "
                                 "--chat-template FILE")
        from transformers.utils.chat_template_utils import render_jinja_template

        with _template_errors():
            rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                                tools=tools, add_generation_prompt=True)
        return rendered[0]


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer (``transformers``), as a model directory ships it."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        self.vocab_size = len(tokenizer)
        # Exactly the ids that decoding with skip_special_tokens drops.
        added = {i: str(t) for i, t in tokenizer.added_tokens_decoder.items()}
        candidates = set(added) | set(tokenizer.all_special_ids)
        self.special = frozenset(
            i for i in candidates
            if tokenizer.decode([i]) and not tokenizer.decode([i], skip_special_tokens=True))
        self.has_chat_template = bool(tokenizer.chat_template)
        self._added = added
        self._pieces = _piece_reader(tokenizer)
        self.decodes_join = [step.get("type") for step in _decoder_steps(tokenizer)] \
            == ["ByteLevel"]
        self._backend_decode = _plain_backend_decode(tokenizer)
        self._backend_encode = _plain_backend_encode(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend_encode is not None:
            return self._backend_encode(text, add_special_tokens=add_special_tokens).ids
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens, verbose=False))

    def decode(self, tokens: Sequence[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(list(tokens), skip_special_tokens=True)
        return self.hf.decode(list(tokens), skip_special_tokens=True,
                              clean_up_tokenization_spaces=False)

    def token_bytes(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token].encode("utf-8")
        piece = self.hf.convert_ids_to_tokens(token)
        return b"" if piece is None else self._pieces(piece)  # None: past the vocabulary

    def render_chat(self, messages: list[dict[str, Any]], template: str | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if template is None and not self.has_chat_template:
            raise NoChatTemplate("this model has no chat template: pass one with "
                                 "--chat-template FILE")
        with _template_errors():
            return self.hf.apply_chat_template(messages, chat_template=template, tools=tools,
                                               tokenize=False, add_generation_prompt=True)

    def _own_template(self) -> str | None:
        template = self.hf.chat_template
        return template if isinstance(template, str) else None


def _plain_backend_decode(tokenizer: Any) -> Callable[..., str] | None:
    """A fast tokenizer's own Rust decode, where transformers' ``decode`` adds nothing to it
    (no class of its own overriding it): the engine decodes a short window at every
    generated token, and the Python around the call costs more than the decode."""
    from transformers import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    plain = (isinstance(tokenizer, TokenizersBackend)
             and kind._decode is TokenizersBackend._decode
             and kind.decode is PreTrainedTokenizerBase.decode)
    return tokenizer.backend_tokenizer.decode if plain else None


# What transformers' encode of one text goes through, each of which a class could override.
_ENCODE_STEPS = ("encode", "_get_padding_truncation_strategies", "_encode_plus",
                 "set_truncation_and_padding", "_convert_encoding")


def _plain_backend_encode(tokenizer: Any) -> Callable[..., Any] | None:
    """A fast tokenizer's own Rust encode, where transformers' ``encode`` of one text is
    only that call (no class of its own overriding a step of it): the Python around it cost
    a third of each prompt's encode, 7% of a server's CPU at 64 streamed clients.

    transformers' encode turns off the backend's truncation and padding and sets whether
    special tokens in the text are split (``split_special_tokens``) before each call; they
    are set here once, as nothing else encodes with this tokenizer."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or any(
            getattr(kind, step) is not getattr(TokenizersBackend, step) for step in _ENCODE_STEPS):
        return None
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    backend.encode_special_tokens = tokenizer.split_special_tokens
    return backend.encode


@contextmanager
def _template_errors() -> Iterator[None]:
    """A template's own errors (``raise_exception``, syntax, undefined values) as
    ``ChatTemplateError`` with the template's message."""
    from jinja2 import TemplateError

    try:
        yield
    except TemplateError as error:
        raise ChatTemplateError(str(error)) from error


def _decoder_steps(tokenizer: Any) -> list[dict[str, Any]]:
    """The steps of a fast tokenizer's decoder, flattened out of ``Sequence``s."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return []
    steps, todo = [], [json.loads(decoder.__getstate__())]
    while todo:
        step = todo.pop(0)
        if step.get("type") == "Sequence":
            todo[:0] = step["decoders"]
        else:
            steps.append(step)
    return steps


def _piece_reader(tokenizer: Any) -> Callable[[str], bytes]:
    """How a vocabulary piece maps to bytes: through the byte-level alphabet (byte-level
    BPE), or ``<0xNN>`` as byte NN and ``▁`` as a space (SentencePiece-style), else as the
    tokenizer decodes the piece alone."""
    types = {step.get("type") for step in _decoder_steps(tokenizer)}
    if "ByteLevel" in types:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        alphabet = {symbol: bytes([byte]) for byte, symbol in bytes_to_unicode().items()}
        return lambda piece: b"".join(alphabet.get(c) or c.encode("utf-8") for c in piece)
    if types & {"Metaspace", "Replace", "ByteFallback"}:
        def metaspace(piece: str) -> bytes:
            byte = BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte[1], 16)]) if byte else \
                piece.replace(METASPACE, " ").encode("utf-8")
        return metaspace
    return lambda piece: tokenizer.convert_tokens_to_string([piece]).encode("utf-8")


def load_tokenizer(path: Path) -> HFTokenizer:
    """The tokenizer saved in model directory ``path``, from local files only and without
    running code from the directory."""
    return HFTokenizer(load_hf_tokenizer(path))
