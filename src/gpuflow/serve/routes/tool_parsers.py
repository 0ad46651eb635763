"""The model's tool calls read from its text as it grows (``--tool-call-parser``): content
and OpenAI's incremental ``tool_calls`` deltas (a call's first delta its index, id, type
and name; later ones fragments of its arguments, as the model writes them).

A reader fed the whole text at once gives the unstreamed answer, so the two always agree:
a call's arguments are the raw JSON text the model wrote for them (a JSON string holding
them is decoded), and the content is the text outside calls without its leading and
trailing whitespace. Text that may still turn out to be a call (a partial ``<tool_call>``,
a leading ``[`` or ``{``) is held back until it is known not to be one.

Syntaxes: ``hermes`` (Hermes and Qwen's ``<tool_call>{"name", "arguments"}</tool_call>``
blocks, text around them the content), ``mistral`` (``[TOOL_CALLS]``, a control token the
detokenized text leaves out, then a JSON list of calls at the start of the answer) and
``llama3_json`` (a bare ``{"name", "parameters"}`` object at the start, several split by
``;``). A call in a syntax of bare JSON names one of the request's tools, or the text is
content."""

from __future__ import annotations

import abc
import json
import uuid
from typing import Any, Protocol

SYNTAXES = ("hermes", "mistral", "llama3_json")
PARSERS = ("auto", *SYNTAXES)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# What begins a call in each syntax, which a chat template for it shows too.
_MARKS = {"mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>", "hermes": OPEN}
_ARGUMENT_KEYS = ("arguments", "parameters")


def syntax_of(parser: str, template: str | None) -> str:
    """The syntax ``--tool-call-parser`` names; for ``auto`` the one the chat template
    writes, Hermes' where it shows none."""
    if parser != "auto":
        return parser
    return next((syntax for syntax, mark in _MARKS.items() if template and mark in template),
                "hermes")


class _Source(Protocol):
    """A call as far as it is written."""

    name: str | None
    closed: bool

    def arguments(self) -> str:
        """The arguments' text so far; each value extends the one before."""


class _CallObject:
    """One call's JSON object read as it grows: its name once written, then its arguments'
    raw text, member by member at the object's top level, whatever the keys' order."""

    def __init__(self) -> None:
        self.text = ""
        self.depth, self.quoted, self.escaped, self.closed = 0, False, False, False
        self.member = self.value = 0  # where the member being read, and its value, start
        self.key: Any = None
        self.name: str | None = None
        self.span: list[int | None] | None = None  # the arguments' start and end

    def feed(self, text: str) -> int:
        """Read ``text`` (the first piece begins with ``{``) up to the object's end; how
        many characters it took."""
        start = len(self.text)
        self.text += text
        for at in range(start, len(self.text)):
            if self._step(self.text[at], at):
                self.closed, self.text = True, self.text[:at + 1]
                return at + 1 - start
        return len(text)

    def _step(self, char: str, at: int) -> bool:
        """Read one character; whether it ends the object."""
        if self.quoted:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.quoted = False
        elif char == '"':
            self.quoted = True
        elif char in "{[":
            self.depth += 1
            if self.depth == 1:
                self.member = at + 1
        elif char in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._member_ends(at)
                return True
        elif self.depth == 1 and char == ":":
            self.key, self.value = _loads(self.text[self.member:at]), at + 1
            if self.key in _ARGUMENT_KEYS and self.span is None:
                self.span = [at + 1, None]
        elif self.depth == 1 and char == ",":
            self._member_ends(at)
            self.member = at + 1
        return False

    def _member_ends(self, at: int) -> None:
        if self.key == "name":
            name = _loads(self.text[self.value:at])
            self.name = name if isinstance(name, str) else self.name
        elif self.span is not None and self.span[1] is None and self.span[0] == self.value:
            self.span[1] = at
        self.key = None

    def arguments(self) -> str:
        if self.span is None:
            return "{}" if self.closed else ""
        start, end = self.span
        raw = self.text[start:end].strip()
        if not raw.startswith('"'):
            return raw
        decoded = _loads(raw) if end is not None else None  # a string holding them
        return decoded if isinstance(decoded, str) else ""


class _NamedArguments:
    """The named function's call: the whole text is its arguments."""

    def __init__(self, name: str) -> None:
        self.name: str | None = name
        self.text, self.closed = "", False

    def arguments(self) -> str:
        return self.text.strip()


class _Call:
    """A call in the answer: its index and id once announced, how much of its arguments
    went out."""

    def __init__(self, source: _Source) -> None:
        self.source, self.id, self.index, self.sent, self.sent_all = source, "", -1, 0, False


class ToolCallReader(abc.ABC):
    """One choice's text, read as it grows, as content and tool calls."""

    def __init__(self) -> None:
        self.pending = ""  # text read but not yet placed
        self.calls: list[_Call] = []
        self.content, self.space, self.said = "", "", ""
        self.announced = 0

    def feed(self, text: str) -> dict[str, Any]:
        """The chat delta that ``text``, the next piece of the answer, adds: its
        ``content`` and ``tool_calls`` (neither when all of it is held back)."""
        self.pending += text
        self._read()
        return self._delta()

    def finish(self) -> dict[str, Any]:
        """The delta of the text still held back once the answer has ended."""
        self._end()
        return self._delta()

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole answer's content (None when empty) and calls, OpenAI's way."""
        self.feed(text)
        self.finish()
        return self.content or None, [
            {"id": call.id, "type": "function",
             "function": {"name": call.source.name, "arguments": call.source.arguments()}}
            for call in self.calls if call.index >= 0]

    @property
    def called(self) -> bool:
        return self.announced > 0

    @abc.abstractmethod
    def _read(self) -> None:
        """Place ``pending``: ``_say`` its content, ``_call`` its calls (each syntax's own)."""

    def _end(self) -> None:
        """Place what ``_read`` held back: content unless it was inside a call."""
        self._say(self.pending)
        self.pending = ""

    def _say(self, text: str) -> None:
        if not self.content and not self.said:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            self.said += self.space + body
            self.space = text[len(body):]
        else:
            self.space += text

    def _call(self, source: _Source) -> None:
        self.calls.append(_Call(source))

    def _delta(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.said:
            delta["content"] = self.said
            self.content, self.said = self.content + self.said, ""
        parts = [part for call in self.calls if not call.sent_all and (part := self._part(call))]
        if parts:
            delta["tool_calls"] = parts
        return delta

    def _part(self, call: _Call) -> dict[str, Any] | None:
        """What of ``call`` is new: its head once named, then its arguments' new text."""
        if call.source.name is None:
            return None
        arguments = call.source.arguments()
        fragment = arguments[call.sent:]
        call.sent, call.sent_all = len(arguments), call.source.closed
        if call.index < 0:
            call.index, call.id = self.announced, f"call_{uuid.uuid4().hex[:24]}"
            self.announced += 1
            return {"index": call.index, "id": call.id, "type": "function",
                    "function": {"name": call.source.name, "arguments": fragment}}
        return {"index": call.index, "function": {"arguments": fragment}} if fragment else None


class _Hermes(ToolCallReader):
    """``<tool_call>{...}</tool_call>`` blocks anywhere in the text."""

    def __init__(self) -> None:
        super().__init__()
        self.block: _CallObject | None = None
        self.inside = False

    def _read(self) -> None:
        while self.pending:
            if not self.inside:
                start = self.pending.find(OPEN)
                if start < 0:
                    cut = len(self.pending) - _partial(self.pending, OPEN)
                    self._say(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return
                self._say(self.pending[:start])
                self.pending, self.inside = self.pending[start + len(OPEN):], True
            elif self.block is not None and not self.block.closed:
                self.pending = self.pending[self.block.feed(self.pending):]
            elif not self._outside_object():
                return

    def _outside_object(self) -> bool:
        """In a block but outside its object: start the object, or leave the block at
        its end; whether there is more to read."""
        end, brace = self.pending.find(CLOSE), self.pending.find("{")
        if self.block is None and brace >= 0 and (end < 0 or brace < end):
            self.block = _CallObject()
            self._call(self.block)
            self.pending = self.pending[brace:]
            return True
        if end < 0:
            self.pending = self.pending[len(self.pending) - _partial(self.pending, CLOSE):]
            return False
        self.pending, self.block, self.inside = self.pending[end + len(CLOSE):], None, False
        return True

    def _end(self) -> None:
        if not self.inside:
            super()._end()


class _LeadingJson(ToolCallReader):
    """Calls as JSON at the start of the answer, after ``marker``: a list of call
    objects, or objects split by ``;``; the text after them is content. The first call
    names one of ``tools``, or the whole text is content."""

    def __init__(self, marker: str, tools: set[str]) -> None:
        super().__init__()
        self.marker, self.tools = marker, tools
        self.held = ""  # the whole text while it is not known to hold calls
        self.state = "start"  # then "calls" or "content"
        self.listed = False
        self.current: _CallObject | None = None

    def _read(self) -> None:
        if self.state == "start" or self.held:
            self.held += self.pending
        if self.state == "start":
            self._start()
        while self.pending and self.state == "calls":
            current = self.current
            if current is not None and not current.closed:
                self.pending = self.pending[current.feed(self.pending):]
                self._decide(current)
            else:
                self._between()
        if self.state == "content":
            self._say(self.pending)
            self.pending = ""

    def _start(self) -> None:
        """Before the first object: past the marker and an opening ``[``, a ``{`` begins
        the calls, anything else is content; too little text yet waits."""
        self.pending = ""
        text = self.held.lstrip()
        if self.marker.startswith(text):
            return
        text = text.removeprefix(self.marker).lstrip()
        self.listed = text.startswith("[")
        text = text.removeprefix("[").lstrip()
        if text.startswith("{"):
            self.state, self.pending = "calls", text
        elif text:
            self.state, self.pending, self.held = "content", self.held, ""

    def _decide(self, first: _CallObject) -> None:
        """Once the first object is named (or ends unnamed): calls, or all content."""
        if not self.held or (first.name is None and not first.closed):
            return
        if first.name in self.tools:
            self.held = ""
            return
        self.calls.clear()
        self.state, self.pending, self.held = "content", self.held, ""

    def _between(self) -> None:
        """After an object: the next one, or the end of the calls."""
        text = self.pending.lstrip().lstrip(",;").lstrip()
        if text.startswith("{"):
            self.current = _CallObject()
            self._call(self.current)
        elif text:
            self.state = "content"
            text = text[1:] if self.listed and text.startswith("]") else text
        self.pending = text

    def _end(self) -> None:
        if self.state == "start" or self.held:  # never known to hold calls
            self.calls.clear()
            self.pending, self.held, self.state = self.held, "", "content"
            super()._end()


class _Named(ToolCallReader):
    """A named function's call (``tool_choice``): the whole text is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.source = _NamedArguments(name)
        self._call(self.source)

    def _read(self) -> None:
        self.source.text += self.pending
        self.pending = ""


def reader(mode: str, syntax: str, tools: set[str]) -> ToolCallReader:
    """The reader of one choice: ``mode`` ``auto`` reads ``syntax``; ``required`` the
    constrained list of calls; any other ``mode`` is the named function's arguments."""
    if mode == "required":
        return _LeadingJson("", tools)
    if mode != "auto":
        return _Named(mode)
    return _Hermes() if syntax == "hermes" else _LeadingJson(_MARKS[syntax], tools)


def _partial(text: str, mark: str) -> int:
    """How many of ``text``'s last characters begin ``mark`` (a mark maybe on its way)."""
    for size in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-size:]):
            return size
    return 0


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
