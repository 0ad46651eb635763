"""Waveform augmentation for the speech workload: new voices from the speakers it has.

Five speakers are few; the model meets a sixth voice as a shifted pitch and formants, another
speaking rate, another microphone's low-frequency response, noise floor and onset. Each
training clip is therefore perturbed in speed (which scales pitch, formants and tempo
together, as Kaldi's speed perturbation does), delayed by a random silence, high-passed at a
random cutoff half the time (a voice recorded without its lowest band must not look like
another digit), and mixed with white noise at a random signal-to-noise ratio
(``WaveAugment``). Loudness is left alone: the model's per-clip
feature normalisation removes it. ``ClipMixup`` then mixes each perturbed clip with another
training clip and their labels (mixup), which measured better on speakers the model never
heard than perturbation alone. The randomness comes from the generator the loader passes
(seeded by seed, epoch and index), so resume stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


@dataclass(frozen=True)
class WaveAugment:
    """``(item, rng) -> item`` for items ``((wave [T], length), label)``."""

    sample_rate: int = 8000
    speed: tuple[float, float] = (0.85, 1.15)
    max_delay_s: float = 0.1
    snr_db: tuple[float, float] = (10.0, 40.0)
    high_pass_probability: float = 0.5
    high_pass_hz: tuple[float, float] = (150.0, 350.0)

    def __call__(self, item: Any, rng: np.random.Generator) -> Any:
        (wave, length), label = item
        clip = wave[: int(length)].numpy().astype(np.float64)
        clip = self.perturb_speed(clip, rng.uniform(*self.speed))
        delay = int(rng.integers(0, int(self.max_delay_s * self.sample_rate) + 1))
        clip = np.concatenate([np.zeros(delay), clip])
        if rng.uniform() < self.high_pass_probability:
            clip = self.high_pass(clip, rng.uniform(*self.high_pass_hz), self.sample_rate)
        clip = clip + self.noise(clip, rng.uniform(*self.snr_db), rng)
        out = torch.from_numpy(clip.astype(np.float32))
        return (out, torch.tensor(out.shape[0], dtype=torch.int64)), label

    @staticmethod
    def perturb_speed(clip: np.ndarray, factor: float) -> np.ndarray:
        """Played ``factor`` times faster: linear resampling to ``len / factor`` samples."""
        frames = max(1, round(clip.shape[0] / factor))
        return np.interp(np.arange(frames) * factor, np.arange(clip.shape[0]), clip)

    @staticmethod
    def high_pass(clip: np.ndarray, cutoff_hz: float, sample_rate: int) -> np.ndarray:
        """``clip`` without its content below ``cutoff_hz / 2``, passed whole above
        ``cutoff_hz`` and faded linearly between: a zero-phase filter applied to the spectrum,
        so the onset stays where the delay put it."""
        spectrum = np.fft.rfft(clip)
        freqs = np.fft.rfftfreq(clip.shape[0], 1.0 / sample_rate)
        gain = np.clip((freqs - 0.5 * cutoff_hz) / (0.5 * cutoff_hz), 0.0, 1.0)
        return np.fft.irfft(spectrum * gain, n=clip.shape[0])

    @staticmethod
    def noise(clip: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
        """White noise ``snr_db`` below the clip's mean power."""
        power = float(np.mean(clip**2)) if clip.size else 0.0
        scale = np.sqrt(power / 10.0 ** (snr_db / 10.0))
        return scale * rng.standard_normal(clip.shape[0])


@dataclass(frozen=True)
class ClipMixup:
    """``(item, rng) -> item``: mixup for clips, drawn per item so that resume stays exact.

    The item and a partner drawn from ``clips`` (the training set) are both perturbed by
    ``perturb``, scaled to the same RMS level and summed with weights ``share`` and
    ``1 - share``, ``share ~ Beta(alpha, alpha)``; the target becomes the same mixture of
    their one-hot labels, a float vector of ``num_classes`` that cross-entropy takes as class
    probabilities. Mixing the waveforms (not the features) keeps it in the data pipeline: the
    model sees an ordinary clip, and the partner and share come from the item's generator.
    """

    clips: Dataset
    perturb: WaveAugment
    num_classes: int
    alpha: float = 0.4

    def __call__(self, item: Any, rng: np.random.Generator) -> Any:
        (wave, _), label = self.perturb(item, rng)
        partner = self.clips[int(rng.integers(len(self.clips)))]  # type: ignore[arg-type]
        (other, _), other_label = self.perturb(partner, rng)
        share = float(rng.beta(self.alpha, self.alpha))
        mixed = torch.zeros(max(wave.shape[0], other.shape[0]))
        mixed[: wave.shape[0]] += share * unit_rms(wave)
        mixed[: other.shape[0]] += (1.0 - share) * unit_rms(other)
        target = torch.zeros(self.num_classes)
        target[int(label)] += share
        target[int(other_label)] += 1.0 - share
        return (mixed, torch.tensor(mixed.shape[0], dtype=torch.int64)), target


def unit_rms(wave: torch.Tensor) -> torch.Tensor:
    """``wave`` scaled to an RMS of 1 (silence stays silent), so a mixture's shares set the
    two clips' relative levels whatever their recording levels were."""
    rms = float(wave.square().mean().sqrt()) if wave.numel() else 0.0
    return wave / rms if rms > 0.0 else wave
