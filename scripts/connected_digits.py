"""Build a connected-digit speech recognition set from the Free Spoken Digit Dataset.

Each utterance joins 2-7 isolated digits of one speaker with short pauses (50-250 ms of
silence), and its transcript spells the digits as words ("four two seven"): a TIDIGITS-like
task on real voices. Every utterance carries its speaker, so the `asr` workload holds whole
speakers out for validation (``--val-speakers``; by default the last by name).

    python scripts/connected_digits.py --recordings free-spoken-digit-dataset/recordings \
        --out data/connected-digits
    gpuflow train --workload asr --data-dir data/connected-digits

Writes ``OUT/audio/{speaker}_{n}.wav`` (8 kHz, 16-bit PCM) and ``OUT/manifest.jsonl``.
The output depends only on the recordings and ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import wave
from collections import defaultdict
from pathlib import Path

import numpy as np

from gpuflow.data.audio import Clip, find_clips, read_wav

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
RATE = 8000


def utterance(clips: list[Clip], rng: np.random.Generator, digits: tuple[int, int],
              pause_s: tuple[float, float]) -> tuple[np.ndarray, str]:
    """One utterance: random clips of one speaker joined by pauses, and its transcript."""
    chosen = [clips[int(i)] for i in rng.integers(0, len(clips), rng.integers(*digits,
                                                                             endpoint=True))]
    parts: list[np.ndarray] = []
    for n, clip in enumerate(chosen):
        if n:
            parts.append(np.zeros(int(rng.uniform(*pause_s) * RATE), dtype=np.float32))
        parts.append(read_wav(clip.path, sample_rate=RATE)[0])
    return np.concatenate(parts), " ".join(WORDS[clip.digit] for clip in chosen)


def write_wav(path: Path, samples: np.ndarray) -> None:
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(RATE)
        writer.writeframes(pcm.tobytes())


def build(recordings: Path, out: Path, per_speaker: int, seed: int = 0,
          digits: tuple[int, int] = (2, 7),
          pause_s: tuple[float, float] = (0.05, 0.25)) -> Path:
    """Write the set; returns the manifest's path."""
    clips, _ = find_clips(recordings)
    by_speaker: dict[str, list[Clip]] = defaultdict(list)
    for clip in clips:
        by_speaker[clip.speaker].append(clip)
    if not by_speaker:
        raise SystemExit(f"{recordings} holds no FSDD recordings ({{digit}}_{{speaker}}_"
                         "{take}.wav)")
    (out / "audio").mkdir(parents=True, exist_ok=True)
    lines = []
    for number, speaker in enumerate(sorted(by_speaker)):
        rng = np.random.default_rng([seed, number])
        for n in range(per_speaker):
            samples, text = utterance(by_speaker[speaker], rng, digits, pause_s)
            name = f"audio/{speaker}_{n:05d}.wav"
            write_wav(out / name, samples)
            lines.append(json.dumps({"audio_filepath": name, "duration": len(samples) / RATE,
                                     "text": text, "speaker": speaker}))
    manifest = out / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recordings", type=Path, required=True,
                        help="the FSDD recordings folder")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the set to")
    parser.add_argument("--per-speaker", type=int, default=400,
                        help="utterances per speaker (default 400)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    manifest = build(args.recordings, args.out, args.per_speaker, args.seed)
    print(f"wrote {manifest}")


if __name__ == "__main__":
    main()
