"""Spoken digits: raw 8 kHz WAV clips in the Free Spoken Digit Dataset layout, 10 classes.

``--data-dir`` holds ``{digit}_{speaker}_{take}.wav`` files. Takes 0-4 of each speaker and
digit are the test set (the dataset's customary split), the rest train. Clips are read once
into memory; features are computed by the model, on the device.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from gpuflow.data.audio import find_clips, read_wav
from gpuflow.data.streaming import open_packed
from gpuflow.errors import UserError
from gpuflow.models.speech import SpeechClassifier
from gpuflow.workload import Workload
from gpuflow.workloads.speech_codec import speech_serving

SAMPLE_RATE = 8000
NUM_CLASSES = 10
TEST_TAKES = range(5)
DATASET_URL = "https://github.com/Jakobovski/free-spoken-digit-dataset"

MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"dim": 64, "depth": 2, "heads": 4},
    "small": {"dim": 96, "depth": 3, "heads": 4},
    "base": {"dim": 192, "depth": 4, "heads": 6},
}
DEFAULT_MODEL_SIZE = "small"

# Synthetic clips mimic the real set: 2,250 train and 250 test clips of 0.15-1 s.
SYNTHETIC_COUNTS = (2250, 250)
SYNTHETIC_LENGTHS = (1200, 8000)

Item = tuple[tuple[torch.Tensor, torch.Tensor], int]
Batch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]


class WaveformDataset(Dataset):
    """In-memory clips: item ``i`` is ``((waveform float32 [T], length int64), label)``."""

    def __init__(self, waves: Sequence[np.ndarray], labels: Sequence[int]) -> None:
        self.waves = list(waves)
        self.labels = list(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Item:
        wave = torch.from_numpy(self.waves[index])
        return (wave, torch.tensor(wave.shape[0], dtype=torch.int64)), self.labels[index]

    def lengths(self) -> list[int]:
        return [len(wave) for wave in self.waves]


class SyntheticWaveforms(Dataset):
    """Random noise clips and labels, each a function of its index only (resume-exact)."""

    def __init__(self, count: int, seed: int) -> None:
        self.count, self.seed = count, seed

    def __len__(self) -> int:
        return self.count

    def _generator(self, index: int) -> tuple[torch.Generator, int]:
        """The item's own generator, after drawing its length (the first draw)."""
        if not 0 <= index < self.count:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        low, high = SYNTHETIC_LENGTHS
        return generator, int(torch.randint(low, high + 1, (1,), generator=generator))

    def __getitem__(self, index: int) -> Item:
        generator, length = self._generator(index)
        wave = 0.1 * torch.randn(length, generator=generator)
        label = int(torch.randint(0, NUM_CLASSES, (1,), generator=generator))
        return (wave, torch.tensor(length, dtype=torch.int64)), label

    def lengths(self) -> list[int]:
        return [self._generator(i)[1] for i in range(self.count)]


def collate_waveforms(items: Sequence[Item]) -> Batch:
    """Zero-pad clips to the longest in the batch; the lengths let the model mask the rest."""
    lengths = torch.stack([length for (_, length), _ in items])
    waves = torch.zeros(len(items), int(lengths.max()), dtype=torch.float32)
    for row, ((wave, length), _) in enumerate(items):
        waves[row, : int(length)] = wave
    labels = torch.tensor([label for _, label in items], dtype=torch.int64)
    return (waves, lengths), labels


def example_batch(dataset: WaveformDataset | SyntheticWaveforms, size: int = 8,
                  batch_size: int = 64) -> Batch:
    """A fixed batch whose padded length is what a typical training batch pads to.

    FLOPs scale with the padded length, which is set by the longest clip in a batch; the
    expected longest of ``batch_size`` random clips is near the ``batch_size/(batch_size+1)``
    length quantile. The other clips are spread over the length distribution. The choice
    depends on the lengths only, not on the file order.
    """
    lengths = np.asarray(dataset.lengths())
    order = np.argsort(lengths, kind="stable")
    quantiles = [(i + 0.5) / size for i in range(size - 1)] + [batch_size / (batch_size + 1)]
    picks = [int(order[min(len(order) - 1, int(q * len(order)))]) for q in quantiles]
    return collate_waveforms([dataset[i] for i in picks])


def load_recordings(data_dir: str | Path) -> tuple[WaveformDataset, WaveformDataset]:
    """Train (takes 5+) and test (takes 0-4) sets from a folder of FSDD-named WAV files."""
    clips, unmatched = find_clips(data_dir)
    if unmatched:
        shown = ", ".join(unmatched[:3]) + (", ..." if len(unmatched) > 3 else "")
        warnings.warn(
            f"speech: ignored {len(unmatched)} .wav file(s) in {data_dir} not named "
            f"{{digit}}_{{speaker}}_{{take}}.wav: {shown}", stacklevel=2,
        )
    if not clips:
        raise UserError(
            f"--data-dir {data_dir} holds no WAV files named {{digit}}_{{speaker}}_{{take}}.wav "
            f"(e.g. 7_jackson_32.wav). Point it at the `recordings` folder of the Free Spoken "
            f"Digit Dataset ({DATASET_URL})."
        )
    splits: dict[bool, tuple[list[np.ndarray], list[int]]] = {True: ([], []), False: ([], [])}
    for clip in clips:
        wave, _ = read_wav(clip.path, sample_rate=SAMPLE_RATE, channels=1)
        if wave.shape[0] == 0:
            raise UserError(f"{clip.path} holds no samples; remove it or re-record it.")
        waves, labels = splits[clip.take in TEST_TAKES]
        waves.append(wave)
        labels.append(clip.digit)
    for is_test, name in ((False, "training (takes 5 and up)"), (True, "test (takes 0-4)")):
        if not splits[is_test][1]:
            raise UserError(
                f"--data-dir {data_dir} has no {name} recordings; the test set is takes 0-4 "
                "of each speaker and digit and the rest train, so both are needed."
            )
    return WaveformDataset(*splits[False]), WaveformDataset(*splits[True])


def raw_splits(data: str, data_dir: str | None) -> tuple[WaveformDataset | SyntheticWaveforms,
                                                         WaveformDataset | SyntheticWaveforms]:
    """Train and test clips: random (``synthetic``) or read from WAV files (``real``)."""
    if data == "synthetic":
        return (SyntheticWaveforms(SYNTHETIC_COUNTS[0], 1),
                SyntheticWaveforms(SYNTHETIC_COUNTS[1], 2))
    if data != "real":
        raise UserError(f"speech: --data must be real or synthetic (got {data!r}).")
    if data_dir is None:
        raise UserError(
            "The speech workload reads the Free Spoken Digit Dataset: 8 kHz mono WAV files "
            "named {digit}_{speaker}_{take}.wav. Get it with `git clone "
            f"{DATASET_URL}` (Jakobovski/free-spoken-digit-dataset) and pass its "
            "recordings folder: --data-dir free-spoken-digit-dataset/recordings. "
            "Or use --data synthetic for a throughput run on random clips."
        )
    return load_recordings(data_dir)


def build(data_dir: str | None = None, data: str = "real",
          model_size: str | None = None) -> Workload:
    """The `speech` workload: a log-mel transformer classifier on spoken-digit WAV files."""
    size = model_size or DEFAULT_MODEL_SIZE
    if size not in MODEL_SIZES:
        raise UserError(
            f"speech: unknown --model-size {model_size!r}; choose one of "
            f"{', '.join(MODEL_SIZES)} (default {DEFAULT_MODEL_SIZE})."
        )
    packed = open_packed(data_dir, "speech") if data == "real" else None
    if packed is not None:
        train, test, example = packed.train, packed.val, packed.example
    else:
        raw_train, test = raw_splits(data, data_dir)
        train, example = raw_train, example_batch(raw_train)
    return Workload(
        name="speech",
        model=SpeechClassifier(num_classes=NUM_CLASSES, sample_rate=SAMPLE_RATE,
                               **MODEL_SIZES[size]),
        train_dataset=train,
        val_dataset=test,
        collate_fn=collate_waveforms,
        example_batch=example,
        serving=speech_serving(NUM_CLASSES, SAMPLE_RATE),
    )
