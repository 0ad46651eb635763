"""Generated text to the stream: stop strings found and cut, and text that may still turn
into a stop string held back until it cannot. The text comes from the tokenizer's
incremental detokenizer, whole characters only."""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Feed generated text; read the text that is safe to send, and whether a stop matched.

    The last ``len(longest stop) - 1`` characters stay unsent until more text shows they
    start no stop string, so a stop is always found whole in the unsent text, however the
    tokens split it.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) - 1 for s in self.stop), default=0)
        self._unsent = ""
        self.text = ""  # everything sent so far
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add generated text; returns the text that can be sent now (none after a stop)."""
        if self.stopped or not text:
            return ""
        self._unsent += text
        if not self.stop:
            return self._send(len(self._unsent))
        found = [at for at in (self._unsent.find(s) for s in self.stop) if at >= 0]
        if found:
            self.stopped = True
            sent = self._send(min(found))
            self._unsent = ""
            return sent
        return self._send(max(0, len(self._unsent) - self._hold))

    def _send(self, count: int) -> str:
        text, self._unsent = self._unsent[:count], self._unsent[count:]
        self.text += text
        return text

    def finish(self, rest: str = "") -> str:
        """The rest of the text at the end of generation, with ``rest`` (what the
        detokenizer still held) run through the stop strings first."""
        sent = self.feed(rest)
        if self.stopped:
            return sent
        return sent + self._send(len(self._unsent))
