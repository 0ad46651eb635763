"""Reading PCM WAV files with the standard library, and finding clips named by their labels.

Only Python's ``wave`` module and numpy are used, so audio workloads add no dependency.
"""

from __future__ import annotations

import re
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpuflow.errors import UserError

# FSDD names: {digit}_{speaker}_{take}.wav, e.g. 7_jackson_32.wav
CLIP_NAME = re.compile(r"^(?P<digit>[0-9])_(?P<speaker>[^_]+)_(?P<take>[0-9]+)\.wav$",
                       re.IGNORECASE)

_PCM_DTYPES = {2: np.dtype("<i2"), 4: np.dtype("<i4")}


def read_wav(path: str | Path, sample_rate: int | None = None,
             channels: int | None = 1) -> tuple[np.ndarray, int]:
    """Samples scaled to [-1, 1] as float32, and the file's sample rate.

    8-, 16- and 32-bit integer PCM are accepted. With ``sample_rate`` or ``channels`` given,
    a file that differs is an error naming the file, because a model trained on one rate
    silently mis-hears another.
    """
    path = Path(path)
    try:
        with wave.open(str(path), "rb") as reader:
            rate = reader.getframerate()
            n_channels = reader.getnchannels()
            width = reader.getsampwidth()
            raw = reader.readframes(reader.getnframes())
    except (wave.Error, EOFError) as exc:
        raise UserError(
            f"{path} is not a readable PCM WAV file ({exc}). Re-export it as 16-bit PCM WAV."
        ) from None
    if sample_rate is not None and rate != sample_rate:
        raise UserError(
            f"{path} has a sample rate of {rate} Hz; this workload needs {sample_rate} Hz. "
            f"Resample it, e.g. `sox {path.name} -r {sample_rate} out.wav`."
        )
    if channels is not None and n_channels != channels:
        raise UserError(
            f"{path} has {n_channels} channel(s); this workload needs {channels} (mono). "
            "Mix it down, e.g. `sox in.wav -c 1 out.wav`."
        )
    if width == 1:
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in _PCM_DTYPES:
        scale = float(2 ** (8 * width - 1))
        samples = np.frombuffer(raw, dtype=_PCM_DTYPES[width]).astype(np.float32) / scale
    else:
        raise UserError(
            f"{path} uses {8 * width}-bit samples; only 8-, 16- and 32-bit integer PCM "
            "WAV files are supported."
        )
    if n_channels > 1:
        samples = samples.reshape(-1, n_channels)
    return samples, rate


@dataclass(frozen=True)
class Clip:
    """One labelled recording, as its file name describes it."""

    path: Path
    digit: int
    speaker: str
    take: int


def parse_clip_name(name: str) -> tuple[int, str, int] | None:
    """``(digit, speaker, take)`` from ``{digit}_{speaker}_{take}.wav``, or None."""
    match = CLIP_NAME.match(name)
    if match is None:
        return None
    return int(match["digit"]), match["speaker"], int(match["take"])


def find_clips(folder: str | Path) -> tuple[list[Clip], list[str]]:
    """Labelled clips in ``folder`` sorted by name, and the .wav names that did not parse.

    Files that are not .wav are ignored; a .wav with another name is returned so the caller
    can say how many it left out rather than drop them silently.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--data-dir {folder} is not a folder.")
    clips: list[Clip] = []
    unmatched: list[str] = []
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.suffix.lower() != ".wav":
            continue
        parsed = parse_clip_name(path.name)
        if parsed is None:
            unmatched.append(path.name)
        else:
            clips.append(Clip(path, *parsed))
    return clips, unmatched
