"""Serving a CTC recogniser: audio files or base64 audio in, transcripts with word timings
out.

Clips are decoded (any format ``gpuflow.data.audio_file`` reads), resampled to the model's
rate, batched by padded length (powers of two) and decoded greedily. Word timings come from
the CTC alignment: a word spans from the first frame that emits its first character to the
last frame that emits its last.
"""

from __future__ import annotations

import tempfile
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpuflow.data.audio_file import read_audio
from gpuflow.errors import UserError
from gpuflow.serving import (
    Codec,
    Decoded,
    InputError,
    PredictRequest,
    ServingSpec,
    b64decode,
    length_bucket,
    length_buckets,
)
from gpuflow.workloads.asr_manifest import AUDIO_SUFFIXES
from gpuflow.workloads.asr_text import Vocabulary

FRAME_SECONDS = 0.04  # one logit frame: 10 ms features, subsampled 4x


def word_timings(best: list[int], vocabulary: Vocabulary,
                 frame_seconds: float = FRAME_SECONDS) -> list[dict[str, Any]]:
    """Words of a frame-by-frame best path with their start and end in seconds."""
    words: list[dict[str, Any]] = []
    chars: list[str] = []
    start = end = 0
    for frame, label in enumerate(best):
        if label == 0:
            continue
        symbol = vocabulary.symbols[label]
        repeat = frame > 0 and best[frame - 1] == label
        if symbol == " ":
            _close(words, chars, start, end, frame_seconds)
            chars = []
        elif not repeat:
            if not chars:
                start = frame
            chars.append(symbol)
        if symbol != " ":
            end = frame
    _close(words, chars, start, end, frame_seconds)
    return words


def _close(words: list[dict[str, Any]], chars: list[str], start: int, end: int,
           frame_seconds: float) -> None:
    if chars:
        words.append({"word": "".join(chars), "start": round(start * frame_seconds, 3),
                      "end": round((end + 1) * frame_seconds, 3)})


class TranscriptionCodec(Codec):
    """Rows are 1-D waves at the model's rate; outputs ``{"text", "duration", "words"}``."""

    kind = "audio"
    file_suffixes = (".json", *AUDIO_SUFFIXES)
    SHORTEST = 8192

    def __init__(self, vocabulary: Vocabulary, sample_rate: int, max_seconds: float) -> None:
        self.vocabulary = vocabulary
        self.sample_rate = sample_rate
        self.longest = int(sample_rate * max_seconds)

    def accepted(self) -> tuple[str, ...]:
        return ("inputs", "audio")

    def clips(self, clips: list[torch.Tensor]) -> Decoded:
        if not clips or any(c.ndim != 1 or len(c) == 0 for c in clips):
            raise InputError("the audio holds no samples.")
        longest = max(len(c) for c in clips)
        if longest > self.longest:
            raise InputError(f"the audio lasts {longest / self.sample_rate:.1f} s, longer "
                             f"than the {self.longest / self.sample_rate:g} s this server "
                             "takes (--max-audio-seconds).")
        return Decoded((self.kind, length_bucket(longest, self.SHORTEST, self.longest)), clips)

    def read(self, source: Path | bytes, name: str) -> Decoded:
        try:
            wave = read_audio(source, self.sample_rate, name=name)
        except UserError as exc:
            raise InputError(str(exc)) from None
        return self.clips([torch.from_numpy(wave)])

    def _decode_inputs(self, inputs: Any, request: PredictRequest) -> Decoded:
        try:
            return self.clips([torch.tensor(c, dtype=torch.float32) for c in inputs])
        except (TypeError, ValueError, RuntimeError):
            raise InputError("inputs must be a list of clips, each a list of samples at "
                             f"{self.sample_rate} Hz.") from None

    def _decode_path(self, path: Path, defaults: dict[str, Any]) -> Decoded:
        return self.read(path, str(path))

    def _decode_audio(self, audio: str, request: PredictRequest) -> Decoded:
        with tempfile.NamedTemporaryFile() as handle:
            handle.write(b64decode(audio, "audio"))
            handle.flush()
            return self.read(Path(handle.name), "the audio field")

    def from_sample(self, inputs: Any, defaults: dict[str, Any]) -> Decoded:
        wave, length = inputs
        return self.clips([wave[: int(length)].float()])

    def warmup_rows(self) -> list[tuple[Hashable, Any]]:
        return [((self.kind, size), torch.zeros(size))
                for size in length_buckets(self.SHORTEST, self.longest)]

    def run(self, runner: Any, key: Hashable, rows: list[Any]) -> list[Any]:
        _, padded = key  # type: ignore[misc]
        waves = torch.zeros(len(rows), padded)
        for i, clip in enumerate(rows):
            waves[i, : len(clip)] = clip
        outputs = runner(waves, torch.tensor([len(clip) for clip in rows]))
        best = outputs["logits"].float().argmax(dim=-1).cpu()
        results = []
        for row, count, clip in zip(best, outputs["frames"].tolist(), rows, strict=True):
            words = word_timings(row[:count].tolist(), self.vocabulary)
            results.append({"text": " ".join(w["word"] for w in words),
                            "duration": len(clip) / self.sample_rate, "words": words})
        return results

    def format(self, output: Any, request: PredictRequest) -> dict[str, Any]:
        return dict(output)


def asr_serving(vocabulary: Vocabulary, sample_rate: int, max_seconds: float) -> ServingSpec:
    def codec(model: nn.Module, state: Mapping[str, Any]) -> TranscriptionCodec:
        return TranscriptionCodec(Vocabulary(state["vocabulary"]), int(state["sample_rate"]),
                                  float(state["max_seconds"]))

    return ServingSpec(codec, {"vocabulary": vocabulary.symbols, "sample_rate": sample_rate,
                               "max_seconds": max_seconds})
