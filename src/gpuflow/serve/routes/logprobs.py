"""Log-probabilities as OpenAI writes them: the completions API's parallel lists (tokens,
their log-probabilities, the top alternatives, offsets into the text), and the chat API's
list of entries with each token's bytes. They are the model's own, before penalties and
temperature; a probability of zero is written as -9999.0 (JSON has no infinity)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gpuflow.serve.generate.sampling import TokenLogprob
from gpuflow.serve.generate.tokenizer import Tokenizer

FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def completion_logprobs(tokenizer: Tokenizer, tokens: Sequence[int],
                        entries: Sequence[TokenLogprob | None]) -> dict[str, Any]:
    """The ``logprobs`` of a completion choice over ``tokens`` (an echoed prompt's, then
    the generated ones); an entry is None where there is no log-probability (the prompt's
    first token). ``text_offset`` counts characters from the start of the choice's text."""
    texts = [tokenizer.token_text(token) for token in tokens]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else _finite(e.logprob) for e in entries],
        "top_logprobs": [None if e is None else
                         {tokenizer.token_text(token): _finite(logprob)
                          for token, logprob in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The ``logprobs`` of a chat choice: one entry per generated token."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": tokenizer.token_text(token), "logprob": _finite(logprob),
                "bytes": list(tokenizer.token_bytes(token))}

    return {"content": [{**entry(e.token, e.logprob),
                         "top_logprobs": [entry(token, logprob) for token, logprob in e.top]}
                        for e in entries]}
