"""Spoken digits: raw 8 kHz WAV clips in the Free Spoken Digit Dataset layout, 10 classes.

``--data-dir`` holds ``{digit}_{speaker}_{take}.wav`` files. Whole speakers are held out for
validation (``--val-speakers``; by default the last by name), because a recogniser is judged
on voices it has not heard. Clips are read once into memory; features are computed by the
model, on the device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from wave import open as open_wav

import numpy as np
import torch
from torch.utils.data import Dataset

from gpuflow.data.audio import Clip, find_clips, read_wav
from gpuflow.data.streaming import open_packed
from gpuflow.errors import UserError
from gpuflow.models.speech import SpeechClassifier
from gpuflow.workload import Workload
from gpuflow.workloads.speech_augment import ClipMixup, WaveAugment
from gpuflow.workloads.speech_codec import speech_serving

if TYPE_CHECKING:
    from gpuflow.data.pack_sources import RecordSource

SAMPLE_RATE = 8000
NUM_CLASSES = 10
TEST_TAKES = range(5)  # the validation takes of the same-speaker split
SAME_SPEAKERS = "none"  # --val-speakers value for that split
DATASET_URL = "https://github.com/Jakobovski/free-spoken-digit-dataset"

MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"dim": 64, "depth": 2, "heads": 4},
    "small": {"dim": 96, "depth": 3, "heads": 4},
    "base": {"dim": 192, "depth": 4, "heads": 6},
}
DEFAULT_MODEL_SIZE = "small"
# Leave-one-speaker-out accuracy kept rising past the trainer's 10 epochs, and with mixup
# past 25 (see docs/workloads/speech.md): augmented and mixed clips give a longer run new
# inputs to learn from.
DEFAULT_EPOCHS = 40.0

# The held-out speakers' accuracy still moves by points from one evaluation to the next
# late in a run; the average of about the last 100 steps' weights judges more steadily and
# measured higher (see docs/workloads/speech.md).
DEFAULT_EMA_DECAY = 0.99

# Synthetic clips mimic the real set: 2,250 train and 250 test clips of 0.15-1 s.
SYNTHETIC_COUNTS = (2250, 250)
SYNTHETIC_LENGTHS = (1200, 8000)

Item = tuple[tuple[torch.Tensor, torch.Tensor], int | torch.Tensor]
Batch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]


class WaveformDataset(Dataset):
    """In-memory clips: item ``i`` is ``((waveform float32 [T], length int64), label)``;
    ``speakers[i]`` says who spoke it."""

    def __init__(self, waves: Sequence[np.ndarray], labels: Sequence[int],
                 speakers: Sequence[str] | None = None) -> None:
        self.waves = list(waves)
        self.labels = list(labels)
        self.speakers = list(speakers) if speakers is not None else [""] * len(self.labels)

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
    """Zero-pad clips to the longest in the batch; the lengths let the model mask the rest.

    Labels are digits (``[B]`` int64) or, for mixed training clips, label weights
    (``[B, classes]`` float: see ``ClipMixup``).
    """
    lengths = torch.stack([length for (_, length), _ in items])
    waves = torch.zeros(len(items), int(lengths.max()), dtype=torch.float32)
    for row, ((wave, length), _) in enumerate(items):
        waves[row, : int(length)] = wave
    labels = torch.stack([torch.as_tensor(label) for _, label in items])
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


def split_clips(clips: Sequence[Clip], val_speakers: str | None,
                data_dir: str | Path) -> tuple[list[Clip], list[Clip]]:
    """Training and validation clips: whole speakers held out, or the same-speaker split.

    ``val_speakers`` is a comma-separated list of speaker names; by default the last
    speaker by name is held out, so validation measures speakers the model never heard.
    ``none`` keeps every speaker in training and validates on takes 0-4 of each (the
    dataset's customary split, which measures only speakers it trained on).
    """
    present = sorted({clip.speaker for clip in clips})
    if val_speakers is not None and val_speakers.strip().lower() == SAME_SPEAKERS:
        return _same_speaker_split(clips, data_dir)
    held = ([name.strip() for name in val_speakers.split(",") if name.strip()]
            if val_speakers is not None else present[-1:])
    unknown = sorted(set(held) - set(present))
    if unknown or not held:
        raise UserError(
            f"--val-speakers {val_speakers!r}: {', '.join(unknown) or 'no name given'} "
            f"{'is' if len(unknown) == 1 else 'are'} not among the speakers in --data-dir "
            f"{data_dir}: {', '.join(present)}. Name one or more of them, comma-separated, "
            f"or `{SAME_SPEAKERS}` to validate on takes 0-4 of every speaker."
        )
    if set(held) == set(present):
        given = (f"--val-speakers {val_speakers}" if val_speakers is not None else
                 "By default the last speaker is held out for validation, which")
        raise UserError(
            f"{given} holds out every speaker in --data-dir {data_dir} "
            f"({', '.join(present)}), leaving none to train on: hold out fewer, or use "
            f"--val-speakers {SAME_SPEAKERS} to validate on takes 0-4 of every speaker."
        )
    return ([c for c in clips if c.speaker not in held], [c for c in clips if c.speaker in held])


def _same_speaker_split(clips: Sequence[Clip],
                        data_dir: str | Path) -> tuple[list[Clip], list[Clip]]:
    """Takes 5 and up of every speaker train, takes 0-4 validate; both must be there."""
    train = [c for c in clips if c.take not in TEST_TAKES]
    val = [c for c in clips if c.take in TEST_TAKES]
    for part, name in ((train, "training (takes 5 and up)"), (val, "test (takes 0-4)")):
        if not part:
            raise UserError(
                f"--data-dir {data_dir} has no {name} recordings; with --val-speakers "
                f"{SAME_SPEAKERS} takes 0-4 of each speaker and digit validate and the "
                "rest train, so both are needed."
            )
    return train, val


def _read_clip(clip: Clip) -> np.ndarray:
    samples, _ = read_wav(clip.path, sample_rate=SAMPLE_RATE, channels=1)
    if samples.shape[0] == 0:
        raise UserError(f"{clip.path} holds no samples; remove it or re-record it.")
    return samples


def read_clips(clips: Sequence[Clip]) -> WaveformDataset:
    """The clips' samples, in memory."""
    return WaveformDataset([_read_clip(clip) for clip in clips], [clip.digit for clip in clips],
                           [clip.speaker for clip in clips])


class ClipFiles(Dataset):
    """The clips read from their files on access, items as ``WaveformDataset`` gives them:
    how ``gpuflow data pack`` reads a set that need not fit in memory."""

    def __init__(self, clips: Sequence[Clip]) -> None:
        self.clips = list(clips)

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int) -> Item:
        samples = torch.from_numpy(_read_clip(self.clips[index]))
        return (samples, torch.tensor(samples.shape[0], dtype=torch.int64)), \
            self.clips[index].digit

    def lengths(self) -> list[int]:
        """Samples per clip, from the WAV headers (mono: one sample a frame)."""
        lengths = []
        for clip in self.clips:
            with open_wav(str(clip.path), "rb") as reader:
                lengths.append(reader.getnframes())
        return lengths


Clips = TypeVar("Clips", WaveformDataset, ClipFiles)


def load_recordings(data_dir: str | Path, val_speakers: str | None = None,
                    read: Callable[[Sequence[Clip]], Clips] = read_clips,  # type: ignore[assignment]
                    ) -> tuple[Clips, Clips]:
    """Train and validation sets from a folder of FSDD-named WAV files (see ``split_clips``),
    read into memory (``read_clips``) or on access (``ClipFiles``)."""
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
    train, val = split_clips(clips, val_speakers, data_dir)
    return read(train), read(val)


def raw_splits(data: str, data_dir: str | None,
               val_speakers: str | None = None) -> tuple[WaveformDataset | SyntheticWaveforms,
                                                         WaveformDataset | SyntheticWaveforms]:
    """Train and test clips: random (``synthetic``) or read from WAV files (``real``)."""
    if data == "synthetic":
        return (SyntheticWaveforms(SYNTHETIC_COUNTS[0], 1),
                SyntheticWaveforms(SYNTHETIC_COUNTS[1], 2))
    if data != "real":
        raise UserError(f"speech: --data must be real or synthetic (got {data!r}).")
    if data_dir is None:
        raise _no_data_dir()
    return load_recordings(data_dir, val_speakers)


def _no_data_dir() -> UserError:
    return UserError(
        "The speech workload reads the Free Spoken Digit Dataset: 8 kHz mono WAV files "
        "named {digit}_{speaker}_{take}.wav. Get it with `git clone "
        f"{DATASET_URL}` (Jakobovski/free-spoken-digit-dataset) and pass its "
        "recordings folder: --data-dir free-spoken-digit-dataset/recordings. "
        "Or use --data synthetic for a throughput run on random clips."
    )


def pack_source(data_dir: str | None) -> RecordSource:
    """The default split's clips read one at a time, for ``gpuflow data pack``: the items,
    order and example batch that training from the raw folder uses, in bounded memory."""
    from gpuflow.data.pack_sources import RecordSource

    if data_dir is None:
        raise _no_data_dir()
    train, val = load_recordings(data_dir, read=ClipFiles)
    return RecordSource("speech", {"train": train, "val": val}, example_batch(train))


def build(data_dir: str | None = None, data: str = "real", model_size: str | None = None,
          val_speakers: str | None = None) -> Workload:
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
        raw_train, test = raw_splits(data, data_dir, val_speakers)
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
        augment=ClipMixup(train, WaveAugment(sample_rate=SAMPLE_RATE), NUM_CLASSES),
        default_epochs=DEFAULT_EPOCHS,
        default_ema_decay=DEFAULT_EMA_DECAY,
    )
