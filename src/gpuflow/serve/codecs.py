"""Request inputs -> model rows -> predictions, one codec per kind of model.

A codec decodes a request into rows and a batching key: rows with the same key can be
stacked into one batch (same kind of input, same padded length). It runs a batch of rows
through the model and formats one row's output for the response. Every codec takes raw
tensors (``inputs``); image, text and speech workloads also take their natural inputs.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import tempfile
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from gpuflow.errors import UserError
from gpuflow.workload import Workload

MAX_NEW_TOKENS = 512
TOP_K_DEFAULT = 5
INPUT_FIELDS = ("inputs", "image", "pixels", "text", "audio")


class InputError(ValueError):
    """A request whose inputs do not fit the model (HTTP 422)."""


class PredictRequest(BaseModel):
    """The body of ``POST /v1/predict``: exactly one of the input fields."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[Any] | None = Field(
        None, description="Raw model inputs: a list of samples, each a nested list with the "
                          "model's per-sample shape (token ids for text models).")
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


def length_bucket(length: int, smallest: int, largest: int) -> int:
    """The padded length for ``length``: the next power of two, within [smallest, largest]."""
    return min(largest, max(smallest, 1 << max(0, math.ceil(math.log2(max(length, 1))))))


def length_buckets(smallest: int, largest: int) -> list[int]:
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    return [*buckets, largest]


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


class Codec:
    """Raw tensors for a model that takes one tensor and returns class logits."""

    kind = "tensor"
    file_suffixes: tuple[str, ...] = (".json",)

    def __init__(self, sample_shape: Sequence[int], dtype: torch.dtype,
                 num_classes: int) -> None:
        self.sample_shape = tuple(sample_shape)
        self.dtype = dtype
        self.labels = [str(i) for i in range(num_classes)]

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

    def _decode_inputs(self, inputs: list[Any], request: PredictRequest) -> Decoded:
        try:
            batch = torch.tensor(inputs, dtype=self.dtype)
        except (TypeError, ValueError, RuntimeError):
            raise InputError("inputs must be a list of equally shaped numeric samples.") from None
        if batch.ndim == 0 or tuple(batch.shape[1:]) != self.sample_shape or len(batch) == 0:
            raise InputError(f"inputs has shape {list(batch.shape)}; this model takes "
                             f"[N, {', '.join(map(str, self.sample_shape))}].")
        return Decoded(self.kind, list(batch.unbind(0)))

    def from_sample(self, inputs: Any, defaults: dict[str, Any]) -> Decoded:
        """A sample of a packed set: already what the model takes, as in training."""
        tensor = torch.as_tensor(inputs).to(self.dtype)
        if tuple(tensor.shape) != self.sample_shape:
            raise InputError(f"a packed sample has shape {list(tensor.shape)}; this model "
                             f"takes {list(self.sample_shape)}.")
        return Decoded(self.kind, [tensor])

    def warmup_rows(self) -> list[tuple[Hashable, Any]]:
        """One row per batching key, to warm up every bucket before serving."""
        return [(self.kind, torch.zeros(self.sample_shape, dtype=self.dtype))]

    def run(self, runner: Any, key: Hashable, rows: list[Any]) -> list[Any]:
        """One batch through the model; one output per row."""
        return list(torch.softmax(runner(torch.stack(rows)), dim=-1).cpu().unbind(0))

    def format(self, output: Any, request: PredictRequest) -> dict[str, Any]:
        return top_labels(output, self.labels, request.top_k)


class ImageCodec(Codec):
    """Grayscale image classifiers: raw tensors, a base64 PNG/JPEG, or pixel rows.

    Pixels (0-255, 0 the background) are scaled to [0, 1] and normalised with the training
    set's mean and standard deviation, as the workload does.
    """

    kind = "image"
    file_suffixes = (".json", ".png", ".jpg", ".jpeg", ".bmp", ".pgm")

    def __init__(self, sample_shape: Sequence[int], num_classes: int,
                 stats: tuple[float, float] | None) -> None:
        super().__init__(sample_shape, torch.float32, num_classes)
        self.stats = stats
        self.height, self.width = self.sample_shape[-2:]

    def accepted(self) -> tuple[str, ...]:
        return ("inputs", "image", "pixels") if self.stats else ("inputs",)

    def _normalise(self, pixels: np.ndarray) -> Decoded:
        assert self.stats is not None
        mean, std = self.stats
        image = torch.from_numpy(pixels.astype(np.float32) / 255.0)
        return Decoded(self.kind, [((image - mean) / std).reshape(self.sample_shape)])

    def _decode_bytes(self, data: bytes) -> Decoded:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as image:
                gray = image.convert("L").resize((self.width, self.height),
                                                 Image.Resampling.BILINEAR)
        except (UnidentifiedImageError, OSError, ValueError):
            raise InputError("image is not a readable PNG or JPEG.") from None
        return self._normalise(np.asarray(gray))

    def _decode_image(self, image: str, request: PredictRequest) -> Decoded:
        return self._decode_bytes(b64decode(image, "image"))

    def _decode_pixels(self, pixels: list[list[float]], request: PredictRequest) -> Decoded:
        array = np.asarray(pixels, dtype=np.float32)
        if array.shape != (self.height, self.width):
            raise InputError(f"pixels has shape {list(array.shape)}; this model takes "
                             f"{self.height} rows of {self.width} pixels.")
        if array.min() < 0 or array.max() > 255:
            raise InputError("pixel values must lie in [0, 255].")
        return self._normalise(array)

    def _decode_path(self, path: Path, defaults: dict[str, Any]) -> Decoded:
        return self._decode_bytes(path.read_bytes())


class SpeechCodec(Codec):
    """Spoken-word classifiers taking ``(waves, lengths)``: a base64 WAV or raw waveforms.

    Clips are batched by padded length (powers of two) and zero-padded; the lengths let the
    model mask the padding.
    """

    kind = "audio"
    file_suffixes = (".json", ".wav")
    SHORTEST = 2048

    def __init__(self, num_classes: int, sample_rate: int, max_seconds: float = 4.0) -> None:
        super().__init__((), torch.float32, num_classes)
        self.sample_rate = sample_rate
        self.longest = int(sample_rate * max_seconds)

    def accepted(self) -> tuple[str, ...]:
        return ("inputs", "audio")

    def _clips(self, clips: list[torch.Tensor]) -> Decoded:
        if not clips or any(c.ndim != 1 or len(c) == 0 for c in clips):
            raise InputError("each clip must be a non-empty list of samples.")
        longest = max(len(c) for c in clips)
        if longest > self.longest:
            raise InputError(f"a clip of {longest} samples is longer than the "
                             f"{self.longest} this server takes "
                             f"({self.longest / self.sample_rate:g} s).")
        return Decoded((self.kind, length_bucket(longest, self.SHORTEST, self.longest)), clips)

    def _decode_inputs(self, inputs: list[Any], request: PredictRequest) -> Decoded:
        try:
            return self._clips([torch.tensor(c, dtype=torch.float32) for c in inputs])
        except (TypeError, ValueError, RuntimeError):
            raise InputError("inputs must be a list of clips, each a list of samples.") from None

    def _decode_path(self, path: Path, defaults: dict[str, Any]) -> Decoded:
        from gpuflow.data.audio import read_wav

        try:
            wave, _ = read_wav(path, sample_rate=self.sample_rate, channels=1)
        except UserError as exc:
            raise InputError(str(exc)) from None
        return self._clips([torch.from_numpy(wave)])

    def from_sample(self, inputs: Any, defaults: dict[str, Any]) -> Decoded:
        wave, length = inputs
        return self._clips([wave[: int(length)].float()])

    def _decode_audio(self, audio: str, request: PredictRequest) -> Decoded:
        with tempfile.NamedTemporaryFile(suffix=".wav") as handle:
            handle.write(b64decode(audio, "audio"))
            handle.flush()
            return self._decode_path(Path(handle.name), {})

    def warmup_rows(self) -> list[tuple[Hashable, Any]]:
        return [((self.kind, size), torch.zeros(size))
                for size in length_buckets(self.SHORTEST, self.longest)]

    def run(self, runner: Any, key: Hashable, rows: list[Any]) -> list[Any]:
        _, padded = key  # type: ignore[misc]
        waves = torch.zeros(len(rows), padded)
        for i, clip in enumerate(rows):
            waves[i, : len(clip)] = clip
        lengths = torch.tensor([len(clip) for clip in rows])
        return list(torch.softmax(runner(waves, lengths), dim=-1).cpu().unbind(0))


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
        super().__init__((), torch.int64, vocab_size)
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

    def _decode_inputs(self, inputs: list[Any], request: PredictRequest) -> Decoded:
        if not inputs or not all(isinstance(p, list) and all(isinstance(t, int) for t in p)
                                 for p in inputs):
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
            logits = runner(buffer[:, :width]).cpu()
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


def _digits_stats() -> tuple[float, float]:
    """Mean and std of the digits training split, as ``gpuflow.workloads.digits`` uses."""
    from gpuflow.workloads import digits

    images, labels = digits.load_digits_tensors()
    generator = torch.Generator().manual_seed(digits.SPLIT_SEED)
    order = torch.randperm(len(labels), generator=generator)
    train = images[order[int(len(labels) * digits.VAL_FRACTION):]]
    return float(train.mean()), float(train.std())


def _mnist_stats(config: dict[str, Any]) -> tuple[float, float] | None:
    """Mean and std of the IDX training images, when they are on this machine."""
    from gpuflow.data.idx import find_split, read_idx
    from gpuflow.workloads.mnist_idx import DEFAULT_DIRS

    if config.get("data") == "synthetic":
        return None
    folders = [Path(config["data_dir"])] if config.get("data_dir") else list(DEFAULT_DIRS)
    for folder in folders:
        try:
            images = read_idx(find_split(folder, "train", "images")).astype(np.float32) / 255.0
        except (UserError, OSError):
            continue
        return float(images.mean()), float(images.std())
    return None


def make_codec(workload: Workload, config: dict[str, Any]) -> Codec:
    """The codec for a workload: by built-in name, else raw tensors from its example batch."""
    model = workload.model
    if workload.name == "textlm":
        return TextCodec(model.config.seq_len, model.config.vocab_size)
    if workload.name == "speech":
        from gpuflow.workloads.speech import SAMPLE_RATE

        return SpeechCodec(model.head.out_features, SAMPLE_RATE)
    inputs, _ = workload.get_example_batch()
    if not isinstance(inputs, torch.Tensor):
        raise UserError(f"Workload {workload.name!r} takes {type(inputs).__name__} inputs; "
                        "serving takes models whose input is one tensor.")
    with torch.inference_mode():
        classes = int(model(inputs[:1]).shape[-1])
    if workload.name == "digits":
        return ImageCodec(inputs.shape[1:], classes, _digits_stats())
    if workload.name == "mnist-idx":
        return ImageCodec(inputs.shape[1:], classes, _mnist_stats(config))
    return Codec(inputs.shape[1:], inputs.dtype, classes)
