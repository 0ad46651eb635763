"""Serving byte-level language models: a prompt (or token ids) -> the next bytes."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpuflow.serving import (
    Codec,
    Decoded,
    InputError,
    PredictRequest,
    ServingSpec,
    length_bucket,
    length_buckets,
    top_labels,
)
from gpuflow.workload import model_logits


@dataclass(frozen=True)
class TextRow:
    tokens: torch.Tensor
    max_new_tokens: int
    temperature: float


def byte_label(value: int) -> str:
    char = chr(value)
    return char if char.isprintable() or char in "\n\t" else f"\\x{value:02x}"


class TextCodec(Codec):
    """Byte-level language models: a prompt (or token ids) -> the next bytes.

    Prompts are batched by padded length and right-padded; the model is causal, so the
    padding after a prompt never changes its logits. Generation appends one byte per step
    to every row (greedy, or sampled with the row's temperature) without a KV cache.
    The prediction is the next byte's distribution plus the completion.
    """

    kind = "text"
    file_suffixes = (".json", ".txt")
    SHORTEST = 16

    def __init__(self, seq_len: int, vocab_size: int = 256) -> None:
        self.seq_len = seq_len
        self.labels = [byte_label(i) for i in range(vocab_size)]

    def accepted(self) -> tuple[str, ...]:
        return ("inputs", "text")

    def _prompts(self, prompts: list[list[int]], request: PredictRequest) -> Decoded:
        new = request.max_new_tokens
        if new >= self.seq_len:
            raise InputError(f"max_new_tokens must be below the model's context "
                             f"({self.seq_len}).")
        keep = self.seq_len - new
        rows = []
        for prompt in prompts:
            tokens = torch.tensor(prompt[-keep:], dtype=torch.int64)
            if tokens.ndim != 1 or len(tokens) == 0:
                raise InputError("each prompt must hold at least one token.")
            if int(tokens.min()) < 0 or int(tokens.max()) >= len(self.labels):
                raise InputError(f"token ids must lie in [0, {len(self.labels) - 1}].")
            rows.append(TextRow(tokens, new, request.temperature))
        longest = max(len(row.tokens) for row in rows)
        return Decoded((self.kind, length_bucket(longest, self.SHORTEST, self.seq_len)), rows)

    def _decode_text(self, text: str, request: PredictRequest) -> Decoded:
        return self._prompts([list(text.encode("utf-8"))], request)

    def _decode_inputs(self, inputs: Any, request: PredictRequest) -> Decoded:
        if not isinstance(inputs, list) or not inputs or not all(
                isinstance(p, list) and all(isinstance(t, int) for t in p) for p in inputs):
            raise InputError("inputs must be a list of prompts, each a list of token ids.")
        return self._prompts(inputs, request)

    def from_sample(self, inputs: Any, defaults: dict[str, Any]) -> Decoded:
        return self._prompts([torch.as_tensor(inputs).tolist()], PredictRequest(**defaults))

    def _decode_path(self, path: Path, defaults: dict[str, Any]) -> Decoded:
        request = PredictRequest(text=path.read_text(encoding="utf-8"), **defaults)
        return self._decode_text(request.text or "", request)

    def warmup_rows(self) -> list[tuple[Hashable, Any]]:
        return [((self.kind, size), TextRow(torch.zeros(size, dtype=torch.int64), 0, 0.0))
                for size in length_buckets(self.SHORTEST, self.seq_len)]

    def run(self, runner: Any, key: Hashable, rows: list[Any]) -> list[Any]:
        count = len(rows)
        buffer = torch.zeros(count, self.seq_len, dtype=torch.int64)
        lengths = torch.tensor([len(row.tokens) for row in rows])
        for i, row in enumerate(rows):
            buffer[i, : len(row.tokens)] = row.tokens
        budgets = torch.tensor([row.max_new_tokens for row in rows])
        temperatures = torch.tensor([row.temperature for row in rows])
        generated = torch.zeros(count, int(budgets.max()), dtype=torch.int64)
        first: torch.Tensor | None = None
        for step in range(max(1, int(budgets.max()))):
            width = length_bucket(int(lengths.max()), self.SHORTEST, self.seq_len)
            logits = model_logits(runner(buffer[:, :width])).cpu()  # a tensor, or .logits
            last = logits[torch.arange(count), lengths - 1]
            probs = torch.softmax(last, dim=-1)
            first = probs if first is None else first
            sampled = torch.multinomial(
                torch.softmax(last / temperatures.clamp_min(1e-6)[:, None], dim=-1), 1
            ).squeeze(1)
            chosen = torch.where(temperatures > 0, sampled, probs.argmax(dim=-1))
            active = budgets > step
            if not bool(active.any()):
                break
            rows_on = torch.nonzero(active).squeeze(1)
            buffer[rows_on, lengths[rows_on]] = chosen[rows_on]
            generated[rows_on, step] = chosen[rows_on]
            lengths = lengths + active.long()
        assert first is not None
        return [(generated[i, : int(budgets[i])].tolist(), first[i]) for i in range(count)]

    def format(self, output: Any, request: PredictRequest) -> dict[str, Any]:
        tokens, probs = output
        return {**top_labels(probs, self.labels, request.top_k),
                "completion": bytes(tokens).decode("utf-8", errors="replace")}


def text_serving(seq_len: int, vocab_size: int) -> ServingSpec:
    def codec(model: nn.Module, state: Mapping[str, Any]) -> TextCodec:
        return TextCodec(int(state["seq_len"]), int(state["vocab_size"]))

    return ServingSpec(codec, {"seq_len": seq_len, "vocab_size": vocab_size})
