"""The serving contract: how a request becomes model inputs and an output an answer.

A codec decodes a request into rows and a batching key: rows with the same key can be
stacked into one batch (same kind of input, same padded length). It runs a batch of rows
through the model and formats one row's output for the response. A workload may declare
its own codec (``Workload.serving``: image, text and speech workloads take their natural
inputs); every other model is served by ``TensorCodec``, which takes the model's inputs as
tensors, tuples or dicts of tensors shaped like its example batch.

What a codec needs from training (normalisation statistics, the input schema) is its
*state*: a JSON-able dict saved with the run at training time (``serving.json``) and read
back from the run or its export, so a server needs neither the training data nor the code
that split it.
"""

from __future__ import annotations

import base64
import binascii
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from gpuflow.input_schema import (  # InputError and InputField: for codecs and routes too
    MASK,
    InputError,
    InputSchema,
)
from gpuflow.input_schema import InputField as InputField

MAX_NEW_TOKENS = 512
TOP_K_DEFAULT = 5
INPUT_FIELDS = ("inputs", "image", "pixels", "text", "audio")
SERVING_FILE = "serving.json"  # in a run dir: the codec's state, saved at training time
RUN_CONFIG_FILE = "gpuflow_run.json"  # beside a Hugging Face export: where it came from


class PredictRequest(BaseModel):
    """The body of ``POST /v1/predict``: exactly one of the input fields."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[Any] | dict[str, Any] | None = Field(
        None, description="Raw model inputs: a list of samples, each a nested list with the "
                          "model's per-sample shape; for a model taking several tensors, an "
                          "object mapping each input's name to such a list.")
    image: str | None = Field(None, description="One image, base64-encoded PNG or JPEG.")
    pixels: list[list[float]] | None = Field(
        None, description="One grayscale image as rows of pixel values in [0, 255].")
    text: str | None = Field(None, description="A prompt for a text model.")
    audio: str | None = Field(None, description="One clip, base64-encoded PCM WAV.")
    max_new_tokens: int = Field(16, ge=0, le=MAX_NEW_TOKENS,
                                description="Text models: bytes to generate.")
    temperature: float = Field(0.0, ge=0.0, le=10.0,
                               description="Text models: 0 is greedy; above 0 samples.")
    top_k: int = Field(TOP_K_DEFAULT, ge=1, le=1000,
                       description="Most probable labels returned with each prediction.")
    timeout_ms: float | None = Field(
        None, gt=0, description="Deadline for this request; at most the server's --timeout-ms.")

    def given(self) -> list[str]:
        return [name for name in INPUT_FIELDS if getattr(self, name) is not None]


@dataclass(frozen=True)
class Decoded:
    """A request's rows and the key of the batches they may join."""

    key: Hashable
    rows: list[Any]


def key_kind(key: Hashable) -> Hashable:
    """The kind of a batching key: a variable-length input's key is ``(kind, padded length)``."""
    return key[0] if isinstance(key, tuple) and key else key


def length_bucket(length: int, smallest: int, largest: int) -> int:
    """The padded length for ``length``: the next power of two, within [smallest, largest]."""
    return min(largest, max(smallest, 1 << max(0, math.ceil(math.log2(max(length, 1))))))


def length_buckets(smallest: int, largest: int) -> list[int]:
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    return [*buckets, largest]


def check_clips(clips: Sequence[torch.Tensor], limit: int, sample_rate: int) -> int:
    """The longest clip's length in samples, once every clip is a non-empty 1-D wave of at
    most ``limit`` samples; otherwise the InputError that names what is wrong."""
    if not clips or any(c.ndim != 1 or len(c) == 0 for c in clips):
        raise InputError("each clip must be a non-empty list of samples.")
    longest = max(len(c) for c in clips)
    if longest > limit:
        raise InputError(f"a clip of {longest / sample_rate:.1f} s is longer than the "
                         f"{limit / sample_rate:g} s this server takes.")
    return longest


def b64decode(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{field} must be base64-encoded bytes.") from None


def top_labels(probs: torch.Tensor, labels: Sequence[str], k: int) -> dict[str, Any]:
    """The argmax label, its probability and the ``k`` most probable labels."""
    values, indices = probs.topk(min(k, probs.numel()))
    top = [{"label": labels[int(i)], "index": int(i), "probability": float(v)}
           for v, i in zip(values, indices, strict=True)]
    return {**top[0], "top": top}


class Codec(ABC):
    """Decodes requests into rows, runs batches of rows, formats each row's output."""

    kind = "tensor"
    file_suffixes: tuple[str, ...] = (".json",)

    def accepted(self) -> tuple[str, ...]:
        return ("inputs",)

    def decode(self, request: PredictRequest) -> Decoded:
        given = request.given()
        if len(given) != 1 or given[0] not in self.accepted():
            raise InputError(f"Give exactly one of {', '.join(self.accepted())} for this "
                             f"{self.kind} model (got {', '.join(given) or 'none'}).")
        return getattr(self, f"_decode_{given[0]}")(getattr(request, given[0]), request)

    def decode_file(self, path: Path, defaults: dict[str, Any]) -> Decoded:
        """A file as a request: a JSON request body, or the codec's natural file type."""
        try:
            if path.suffix == ".json":
                return self.decode(PredictRequest.model_validate_json(path.read_bytes()))
            return self._decode_path(path, defaults)
        except (InputError, ValueError, OSError) as exc:
            raise InputError(f"{path}: {exc}") from None

    def _decode_path(self, path: Path, defaults: dict[str, Any]) -> Decoded:
        raise InputError(f"cannot read {path.suffix} files; give {self.file_suffixes}")

    @abstractmethod
    def _decode_inputs(self, inputs: Any, request: PredictRequest) -> Decoded:
        """The rows of a request's ``inputs`` field."""

    @abstractmethod
    def from_sample(self, inputs: Any, defaults: dict[str, Any]) -> Decoded:
        """A sample of a packed set: already what the model takes, as in training."""

    @abstractmethod
    def warmup_rows(self) -> list[tuple[Hashable, Any]]:
        """One row per batching key, a kind's smallest first, to warm up before serving."""

    @abstractmethod
    def run(self, runner: Any, key: Hashable, rows: list[Any]) -> list[Any]:
        """One batch through the model; one output per row."""

    @abstractmethod
    def format(self, output: Any, request: PredictRequest) -> dict[str, Any]:
        """One row's output as the answer's JSON."""


def class_labels(count: int) -> list[str]:
    return [str(i) for i in range(count)]


def classify(logits: torch.Tensor) -> list[torch.Tensor]:
    """Each row's class probabilities."""
    return list(torch.softmax(logits.float(), dim=-1).cpu().unbind(0))


class TensorCodec(Codec):
    """Any model: its inputs as tensors (``{"inputs": [...]}``), or for a model taking
    several, one field each (``{"inputs": {"input_ids": [...], "attention_mask": [...]}}``),
    checked against the example batch's dtypes and per-sample shapes.

    A sequence model (``InputSchema.max_length``) takes any length from 1 to its context:
    requests are batched by padded length (``length_bucket``), rows right-padded with zeros,
    and a model whose ``forward`` takes an attention mask its inputs do not hold is given one
    (``keywords``: the names to call it by). Outputs whose second dimension is the padded
    length (``[N, T, ...]``, e.g. a causal LM's logits) are cut to each sample's own length.

    Class logits (``[N, classes]``, alone or as ``.logits``) are answered as the top-k
    labels; any other output as its tensors, by name.
    """

    SHORTEST = 16  # the smallest padded length, as for text prompts

    def __init__(self, schema: InputSchema, keywords: tuple[str, ...] | None = None) -> None:
        self.schema = schema
        self.fields = schema.fields
        self.keywords = keywords

    def _width(self, lengths: Sequence[int]) -> int:
        """The padded length of sequences this long: part of the batching key."""
        return length_bucket(max(lengths), self.SHORTEST, self.schema.max_length or 0)

    def _decoded(self, rows: list[tuple[torch.Tensor, ...]]) -> Decoded:
        """Rows with their batching key: the kind, and for sequences the padded length."""
        if self.schema.max_length is None:
            return Decoded(self.kind, rows)
        return Decoded((self.kind, self._width([self.schema.length(r) for r in rows])), rows)

    def _decode_inputs(self, inputs: Any, request: PredictRequest) -> Decoded:
        if self.schema.call == "tensor":
            if not isinstance(inputs, list):
                raise InputError(f"inputs must be a list of samples; this model takes "
                                 f"{self.fields[0].describe()}.")
            columns = [self.fields[0].samples(inputs, "inputs")]
        else:
            names = [f.name for f in self.fields]
            if not isinstance(inputs, dict):
                raise InputError(f"inputs must be an object with the fields {', '.join(names)}.")
            missing = [n for n in names if n not in inputs]
            extra = [n for n in inputs if n not in names]
            if missing or extra:
                problem = (f"is missing {', '.join(map(repr, missing))}" if missing
                           else f"has unknown {', '.join(map(repr, extra))}")
                raise InputError(f"inputs {problem}; this model takes "
                                 + ", ".join(f"{f.name} {f.describe()}" for f in self.fields)
                                 + ".")
            columns = [f.samples(inputs[f.name], f"inputs.{f.name}") for f in self.fields]
            if len({len(column) for column in columns}) > 1:
                raise InputError("every field of inputs must hold the same number of samples.")
        return self._decoded([self.schema.row(r) for r in zip(*columns, strict=True)])

    def from_sample(self, inputs: Any, defaults: dict[str, Any]) -> Decoded:
        tensors = self.schema.tensors(inputs)
        return self._decoded([self.schema.row(
            [f.sample(t, f"a packed sample's {f.name}")
             for f, t in zip(self.fields, tensors, strict=True)])])

    def warmup_rows(self) -> list[tuple[Hashable, Any]]:
        """One row per key: for a sequence model one per padded length, smallest first."""
        limit = self.schema.max_length
        sizes = [0] if limit is None else length_buckets(self.SHORTEST, limit)
        rows = [tuple(f.example(size) for f in self.fields) for size in sizes]
        return [(self._decoded([row]).key, row) for row in rows]

    def _inputs(self, rows: list[Any]) -> tuple[Any, list[int] | None]:
        """The model's inputs for ``rows`` and, for sequences, each row's length."""
        if self.schema.max_length is None:
            return self.schema.inputs([torch.stack(c) for c in zip(*rows, strict=True)]), None
        lengths = [self.schema.length(row) for row in rows]
        columns, mask = self.schema.padded(rows, self._width(lengths))
        if self.keywords is None:
            return self.schema.inputs(columns), lengths
        return {**dict(zip(self.keywords, columns, strict=True)), MASK: mask}, lengths

    def run(self, runner: Any, key: Hashable, rows: list[Any]) -> list[Any]:
        inputs, lengths = self._inputs(rows)
        outputs = runner.call(inputs)
        logits = _class_logits(outputs)
        if logits is not None:
            return classify(logits)
        named = _named_tensors(outputs)
        if lengths is None:
            return [{name: tensor[i] for name, tensor in named.items()} for i in range(len(rows))]
        width = self._width(lengths)
        return [{name: tensor[i, :length] if tensor.ndim >= 3 and tensor.shape[1] == width
                 else tensor[i] for name, tensor in named.items()}
                for i, length in enumerate(lengths)]

    def format(self, output: Any, request: PredictRequest) -> dict[str, Any]:
        if isinstance(output, torch.Tensor):
            return top_labels(output, class_labels(output.numel()), request.top_k)
        return {"outputs": {name: tensor.tolist() for name, tensor in output.items()}}


def _class_logits(outputs: Any) -> torch.Tensor | None:
    """Class logits ``[N, classes]``: the output itself, or its ``.logits``."""
    found = outputs if isinstance(outputs, torch.Tensor) else getattr(outputs, "logits", None)
    return found if isinstance(found, torch.Tensor) and found.ndim == 2 else None


def _named_tensors(outputs: Any) -> dict[str, torch.Tensor]:
    """Every per-sample tensor of an output, by name (a tuple's by position)."""
    if isinstance(outputs, torch.Tensor):
        return {"output": outputs.cpu()}
    items = outputs.items() if isinstance(outputs, Mapping) else enumerate(outputs)
    return {str(name): value.cpu() for name, value in items
            if isinstance(value, torch.Tensor) and value.ndim > 0}


@dataclass(frozen=True)
class ServingSpec:
    """A workload's own codec: ``state`` is saved with the run at training time and handed
    to ``codec`` with the trained model when a server loads it."""

    codec: Callable[[nn.Module, Mapping[str, Any]], Codec]
    state: Mapping[str, Any]
