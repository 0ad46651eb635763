"""Clips in the Free Spoken Digit Dataset's layout, synthesised: tone "words" whose pitches
encode the digit, written as WAV files, for the speech tests that need no real recordings."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

# The real recordings, beside the project (also in CI), for the tests that learn from them.
SHARED_RECORDINGS = Path(__file__).resolve().parents[1].parent / "shared/data/fsdd/recordings"
RATE = 8000


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE, width: int = 2,
              channels: int = 1) -> Path:
    """Integer PCM from float samples in [-1, 1] (interleaved if ``channels`` > 1)."""
    if width == 1:
        data = np.clip(np.round(samples * 128 + 128), 0, 255).astype(np.uint8).tobytes()
    else:
        scale = 2 ** (8 * width - 1)
        dtype = {2: "<i2", 4: "<i4"}[width]
        data = np.clip(np.round(samples * scale), -scale, scale - 1).astype(dtype).tobytes()
    with wave.open(str(path), "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(width)
        writer.setframerate(rate)
        writer.writeframes(data)
    return path


def tone_clip(digit: int, speaker: int, take: int) -> np.ndarray:
    """A digit 'word': two tones whose pitches encode the digit, between short silences.

    Speakers shift the pitch and takes the length and loudness, so the classes differ by
    spectral shape over time, as spoken digits do, not by one constant feature.
    """
    rng = np.random.default_rng(1000 * digit + 100 * speaker + take)
    shift = 1.0 + 0.03 * (speaker - 1)
    first, second = (300 + 170 * digit) * shift, (2900 - 210 * digit) * shift
    segment = int(RATE * rng.uniform(0.12, 0.25))
    t = np.arange(segment) / RATE
    envelope = np.hanning(segment)
    word = np.concatenate([np.sin(2 * np.pi * first * t) * envelope,
                           np.sin(2 * np.pi * second * t) * envelope])
    silence = int(RATE * 0.05)
    clip = np.concatenate([np.zeros(silence), rng.uniform(0.3, 0.8) * word, np.zeros(silence)])
    return (clip + 0.01 * rng.standard_normal(clip.shape[0])).astype(np.float32)


def synthesise_fsdd(folder: Path, speakers: int = 3, takes: int = 12) -> Path:
    """A folder in the FSDD layout: {digit}_{speaker}_{take}.wav."""
    folder.mkdir(parents=True, exist_ok=True)
    for digit in range(10):
        for speaker in range(speakers):
            for take in range(takes):
                write_wav(folder / f"{digit}_spk{speaker}_{take}.wav",
                          tone_clip(digit, speaker, take))
    return folder
