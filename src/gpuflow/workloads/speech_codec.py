"""Serving spoken-word classifiers taking ``(waves, lengths)``: a base64 WAV or raw waves."""

from __future__ import annotations

import tempfile
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpuflow.errors import UserError
from gpuflow.serving import (
    Codec,
    Decoded,
    InputError,
    PredictRequest,
    ServingSpec,
    b64decode,
    check_clips,
    class_labels,
    classify,
    length_bucket,
    length_buckets,
    top_labels,
)


class SpeechCodec(Codec):
    """Clips are batched by padded length (powers of two) and zero-padded; the lengths let
    the model mask the padding."""

    kind = "audio"
    file_suffixes = (".json", ".wav")
    SHORTEST = 2048

    def __init__(self, num_classes: int, sample_rate: int, max_seconds: float = 4.0) -> None:
        self.labels = class_labels(num_classes)
        self.sample_rate = sample_rate
        self.longest = int(sample_rate * max_seconds)

    def accepted(self) -> tuple[str, ...]:
        return ("inputs", "audio")

    def _clips(self, clips: list[torch.Tensor]) -> Decoded:
        longest = check_clips(clips, self.longest, self.sample_rate)
        return Decoded((self.kind, length_bucket(longest, self.SHORTEST, self.longest)), clips)

    def _decode_inputs(self, inputs: Any, request: PredictRequest) -> Decoded:
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
        return classify(runner(waves, lengths))

    def format(self, output: Any, request: PredictRequest) -> dict[str, Any]:
        return top_labels(output, self.labels, request.top_k)


def speech_serving(num_classes: int, sample_rate: int) -> ServingSpec:
    def codec(model: nn.Module, state: Mapping[str, Any]) -> SpeechCodec:
        return SpeechCodec(int(state["classes"]), int(state["sample_rate"]))

    return ServingSpec(codec, {"classes": num_classes, "sample_rate": sample_rate})
