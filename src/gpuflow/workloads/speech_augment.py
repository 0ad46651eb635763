"""Waveform augmentation for the speech workload: new voices from the speakers it has.

Five speakers are few; the model meets a sixth voice as a shifted pitch and formants, another
speaking rate, another microphone's noise floor and another onset. Each training clip is
therefore perturbed in speed (which scales pitch, formants and tempo together, as Kaldi's
speed perturbation does), delayed by a random silence, and mixed with white noise at a
random signal-to-noise ratio. Loudness is left alone: the model's per-clip feature
normalisation removes it. The randomness comes from the generator the loader passes
(seeded by seed, epoch and index), so resume stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class WaveAugment:
    """``(item, rng) -> item`` for items ``((wave [T], length), label)``."""

    sample_rate: int = 8000
    speed: tuple[float, float] = (0.85, 1.15)
    max_delay_s: float = 0.1
    snr_db: tuple[float, float] = (10.0, 40.0)

    def __call__(self, item: Any, rng: np.random.Generator) -> Any:
        (wave, length), label = item
        clip = wave[: int(length)].numpy().astype(np.float64)
        clip = self.perturb_speed(clip, rng.uniform(*self.speed))
        delay = int(rng.integers(0, int(self.max_delay_s * self.sample_rate) + 1))
        clip = np.concatenate([np.zeros(delay), clip])
        clip = clip + self.noise(clip, rng.uniform(*self.snr_db), rng)
        out = torch.from_numpy(clip.astype(np.float32))
        return (out, torch.tensor(out.shape[0], dtype=torch.int64)), label

    @staticmethod
    def perturb_speed(clip: np.ndarray, factor: float) -> np.ndarray:
        """Played ``factor`` times faster: linear resampling to ``len / factor`` samples."""
        frames = max(1, round(clip.shape[0] / factor))
        return np.interp(np.arange(frames) * factor, np.arange(clip.shape[0]), clip)

    @staticmethod
    def noise(clip: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
        """White noise ``snr_db`` below the clip's mean power."""
        power = float(np.mean(clip**2)) if clip.size else 0.0
        scale = np.sqrt(power / 10.0 ** (snr_db / 10.0))
        return scale * rng.standard_normal(clip.shape[0])
