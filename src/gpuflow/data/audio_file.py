"""Audio of any common format, rate and channel count as mono float32 at the model's rate.

``soundfile`` (libsndfile) decodes WAV, FLAC, Ogg/Vorbis/Opus and MP3; channels are averaged
(downmix) and the rate converted by windowed-sinc interpolation in torch (torchaudio, which
would do it, has no build for the torch gpuflow pins).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile
import torch
import torch.nn.functional as F

from gpuflow.errors import UserError

FORMATS = "WAV, FLAC, Ogg (Vorbis, Opus) or MP3"


def read_audio(source: str | Path | bytes | BinaryIO, sample_rate: int,
               name: str | None = None) -> np.ndarray:
    """Mono samples in [-1, 1] at ``sample_rate``; a file that does not decode is a
    UserError naming it (``name``, else the path)."""
    label = name or (str(source) if isinstance(source, str | Path) else "the audio")
    handle = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        samples, rate = soundfile.read(handle, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise UserError(f"{label} is not audio gpuflow can decode ({exc}); use {FORMATS}."
                        ) from None
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    return resample(np.ascontiguousarray(mono, dtype=np.float32), int(rate), sample_rate)


def audio_seconds(path: str | Path) -> float:
    """The duration of an audio file from its header."""
    try:
        info = soundfile.info(str(path))
    except (soundfile.LibsndfileError, RuntimeError) as exc:
        raise UserError(f"{path} is not audio gpuflow can decode ({exc}); use {FORMATS}."
                        ) from None
    return float(info.frames) / float(info.samplerate)


def resample(wave: np.ndarray, orig: int, new: int, zeros: int = 6,
             rolloff: float = 0.99) -> np.ndarray:
    """``wave`` from ``orig`` Hz to ``new`` Hz: band-limited (Hann-windowed sinc, ``zeros``
    zero crossings each side, cut at ``rolloff`` of the lower Nyquist), applied as one
    strided convolution over the polyphase kernels of the reduced ratio."""
    if orig == new or wave.size == 0:
        return wave
    divisor = math.gcd(orig, new)
    orig, new = orig // divisor, new // divisor
    base = min(orig, new) * rolloff
    width = math.ceil(zeros * orig / base)
    offsets = torch.arange(-width, width + orig, dtype=torch.float64)[None, :] / orig
    phases = torch.arange(0, -new, -1, dtype=torch.float64)[:, None] / new
    times = ((phases + offsets) * base).clamp(-zeros, zeros)
    window = torch.cos(times * math.pi / zeros / 2) ** 2
    times = times * math.pi
    sinc = torch.where(times == 0, torch.ones_like(times), torch.sin(times) / times)
    kernels = (sinc * window * base / orig).to(torch.float32)[:, None, :]
    signal = F.pad(torch.from_numpy(wave)[None, None, :], (width, width + orig))
    out = F.conv1d(signal, kernels, stride=orig)[0].transpose(0, 1).reshape(-1)
    return out[: math.ceil(new * wave.size / orig)].numpy()
