"""Serving a CTC recogniser: audio files or base64 audio in, transcripts with word timings
out.

Clips are decoded (any format ``gpuflow.data.audio_file`` reads), resampled to the model's
rate, batched by padded length (powers of two) and decoded greedily. A clip longer than the
run's ``--max-audio-seconds`` (up to ``LONGEST_SECONDS``) is cut into chunks at its quietest
moments and each chunk is a row of its own; ``join`` puts their transcripts back together.
Word timings come from the CTC alignment: a word spans from the first frame that emits its
first character to the last frame that emits its last, offset by its chunk's start.
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
    check_clips,
    length_bucket,
    length_buckets,
)
from gpuflow.workloads.asr_manifest import AUDIO_SUFFIXES
from gpuflow.workloads.asr_text import Vocabulary

FRAME_SECONDS = 0.04  # one logit frame: 10 ms features, subsampled 4x
LONGEST_SECONDS = 600.0  # the longest audio a request may hold, in chunks
SEARCH_SECONDS = 5.0  # a chunk ends at the quietest 50 ms of its last SEARCH_SECONDS


def chunk_starts(wave: torch.Tensor, size: int, sample_rate: int) -> list[int]:
    """Where the chunks of ``wave`` (none longer than ``size`` samples) start: each cut at
    the quietest 50 ms window of the chunk's last ``SEARCH_SECONDS``, so words stay whole."""
    starts, window = [0], max(1, sample_rate // 20)
    search = min(size // 2, int(SEARCH_SECONDS * sample_rate))
    while len(wave) - starts[-1] > size:
        end = starts[-1] + size
        region = wave[end - search:end]
        energy = region[: len(region) // window * window].reshape(-1, window).square().sum(1)
        starts.append(end - search + int(energy.argmin()) * window + window // 2)
    return starts


def join(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """One transcript from a clip's chunks, in order."""
    words = [word for output in outputs for word in output["words"]]
    return {"text": " ".join(o["text"] for o in outputs if o["text"]),
            "duration": sum(o["duration"] for o in outputs), "words": words}


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
    """Rows are ``(wave at the model's rate, its start in the clip in seconds)``; outputs
    ``{"text", "duration", "words"}``, one per chunk (``join`` makes them one)."""

    kind = "audio"
    file_suffixes = (".json", *AUDIO_SUFFIXES)
    SHORTEST = 8192

    def __init__(self, vocabulary: Vocabulary, sample_rate: int, max_seconds: float) -> None:
        self.vocabulary = vocabulary
        self.sample_rate = sample_rate
        self.longest = int(sample_rate * max_seconds)  # one chunk
        self.limit = int(sample_rate * max(max_seconds, LONGEST_SECONDS))

    def accepted(self) -> tuple[str, ...]:
        return ("inputs", "audio")

    join = staticmethod(join)

    def clips(self, clips: list[torch.Tensor]) -> Decoded:
        """Each clip's chunks as rows, batched by the longest chunk's padded length."""
        check_clips(clips, self.limit, self.sample_rate)
        rows = []
        for clip in clips:
            starts = chunk_starts(clip, self.longest, self.sample_rate)
            rows += [(clip[a:b], a / self.sample_rate)
                     for a, b in zip(starts, [*starts[1:], len(clip)], strict=True)]
        widest = max(len(wave) for wave, _ in rows)
        return Decoded((self.kind, length_bucket(widest, self.SHORTEST, self.longest)), rows)

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
        return [((self.kind, size), (torch.zeros(size), 0.0))
                for size in length_buckets(self.SHORTEST, self.longest)]

    def run(self, runner: Any, key: Hashable, rows: list[Any]) -> list[Any]:
        _, padded = key  # type: ignore[misc]
        waves = torch.zeros(len(rows), padded)
        for i, (clip, _) in enumerate(rows):
            waves[i, : len(clip)] = clip
        outputs = runner(waves, torch.tensor([len(clip) for clip, _ in rows]))
        best = outputs["logits"].float().argmax(dim=-1).cpu()
        results = []
        for row, count, (clip, start) in zip(best, outputs["frames"].tolist(), rows,
                                             strict=True):
            words = [{**word, "start": round(word["start"] + start, 3),
                      "end": round(word["end"] + start, 3)}
                     for word in word_timings(row[:count].tolist(), self.vocabulary)]
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
