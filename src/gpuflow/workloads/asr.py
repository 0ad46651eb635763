"""Speech recognition: utterances of any length to text, a conformer trained with CTC.

``--data-dir`` holds NeMo-style JSONL manifests or audio with ``.txt`` transcripts
(``gpuflow.workloads.asr_manifest``); ``scripts/connected_digits.py`` builds one from the
Free Spoken Digit Dataset. Audio is decoded and resampled to 16 kHz on access; training
batches are duration buckets filled to ``--batch-seconds`` (``gpuflow.data.duration_buckets``);
validation reports word and character error rates of greedy decoding. See
docs/workloads/asr.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from gpuflow.data.audio_file import read_audio
from gpuflow.data.duration_buckets import DurationBuckets, bucket_batches
from gpuflow.errors import UserError
from gpuflow.models.asr import ConformerCTC
from gpuflow.workload import IGNORE_INDEX, Ratio, Workload
from gpuflow.workloads.asr_codec import asr_serving
from gpuflow.workloads.asr_decode import decode_batch, error_counts
from gpuflow.workloads.asr_manifest import Utterance, load_splits
from gpuflow.workloads.asr_synthetic import COUNTS as SYNTHETIC_COUNTS
from gpuflow.workloads.asr_synthetic import SyntheticUtterances
from gpuflow.workloads.asr_text import Vocabulary
from gpuflow.workloads.speech_augment import WaveAugment

SAMPLE_RATE = 16000
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"dim": 64, "depth": 2, "heads": 4},
    "small": {"dim": 144, "depth": 4, "heads": 4},
    "base": {"dim": 256, "depth": 8, "heads": 4},
}
DEFAULT_MODEL_SIZE = "small"
DEFAULT_BATCH_SECONDS = 60.0
DEFAULT_MAX_AUDIO_SECONDS = 30.0
DEFAULT_EPOCHS = 30.0
SPEED = (0.9, 1.1)  # speed perturbation; CTC's length check allows for the fastest

Item = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]
Batch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]


class Utterances(Dataset):
    """Item ``i``: ``((waveform float32 [T] at 16 kHz, T), character ids [L])``, the audio
    read from its file on access."""

    def __init__(self, utterances: Sequence[Utterance], vocabulary: Vocabulary) -> None:
        self.utterances = list(utterances)
        self.vocabulary = vocabulary

    def __len__(self) -> int:
        return len(self.utterances)

    def __getitem__(self, index: int) -> Item:
        utterance = self.utterances[index]
        wave = torch.from_numpy(read_audio(utterance.path, SAMPLE_RATE))
        ids = torch.tensor(self.vocabulary.encode(utterance.text), dtype=torch.int64)
        return (wave, torch.tensor(wave.shape[0], dtype=torch.int64)), ids

    def durations(self) -> list[float]:
        return [u.duration for u in self.utterances]


def collate_utterances(items: Sequence[Item]) -> Batch:
    """Waves zero-padded to the longest, transcripts padded with ``IGNORE_INDEX``."""
    lengths = torch.stack([length for (_, length), _ in items])
    waves = torch.zeros(len(items), int(lengths.max()), dtype=torch.float32)
    targets = torch.full((len(items), max(1, max(len(ids) for _, ids in items))), IGNORE_INDEX,
                         dtype=torch.int64)
    for row, ((wave, length), ids) in enumerate(items):
        waves[row, : int(length)] = wave[: int(length)]
        targets[row, : len(ids)] = ids
    return (waves, lengths), targets


def padding(inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Samples of audio in a batch, and its padded samples."""
    waves, lengths = inputs
    return lengths.sum(), waves.numel()


def ctc_loss(outputs: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """CTC in fp32, summed over the batch and divided by its target characters (not
    torch's mean of per-utterance means), so each character weighs the same whatever the
    length of its transcript; training weighs batches by :func:`target_characters`."""
    log_probs = torch.log_softmax(outputs["logits"].float(), dim=-1).transpose(0, 1)
    lengths = (target != IGNORE_INDEX).sum(dim=1)
    total = F.ctc_loss(log_probs, target.clamp(min=0), outputs["frames"], lengths, blank=0,
                       reduction="sum", zero_infinity=True)
    return total / lengths.sum().clamp(min=1)


def target_characters(target: torch.Tensor) -> torch.Tensor:
    """The loss units of a batch (``Workload.loss_units``): what :func:`ctc_loss` averages
    over, so that ranks with more characters weigh more and DDP trains as one process."""
    return (target != IGNORE_INDEX).sum()


def error_metric(vocabulary: Vocabulary, unit: str, outputs: dict[str, torch.Tensor],
                 target: torch.Tensor) -> Ratio:
    """Greedy transcripts against the references: errors over reference ``unit``s."""
    hypotheses = decode_batch(outputs["logits"], outputs["frames"], vocabulary)
    references = [vocabulary.decode(row[row != IGNORE_INDEX].tolist()) for row in target]
    return Ratio(*map(float, error_counts(references, hypotheses, unit)))


def ctc_frames_needed(ids: Sequence[int]) -> int:
    """Frames CTC needs for ``ids``: one per label, and a blank between repeated labels."""
    return len(ids) + sum(a == b for a, b in zip(ids, ids[1:], strict=False))


def alignable(utterances: Sequence[Utterance], vocabulary: Vocabulary, model: ConformerCTC,
              max_seconds: float, split: str) -> list[Utterance]:
    """The utterances training can use: within ``max_seconds``, and with at least as many
    frames (at the fastest speed perturbation) as their transcript needs; the rest are
    counted in a warning."""
    kept, long, short, empty = [], 0, 0, 0
    samples = torch.tensor([int(u.duration * SAMPLE_RATE / SPEED[1]) for u in utterances])
    frames = model.output_frames(samples).tolist() if utterances else []
    for utterance, count in zip(utterances, frames, strict=True):
        ids = vocabulary.encode(utterance.text)
        if utterance.duration > max_seconds:
            long += 1
        elif not ids:
            empty += 1
        elif ctc_frames_needed(ids) > count:
            short += 1
        else:
            kept.append(utterance)
    if long or short or empty:
        warnings.warn(
            f"asr: dropped {long + short + empty} {split} utterance(s): {long} longer than "
            f"--max-audio-seconds {max_seconds:g}, {short} whose transcript needs more CTC "
            f"frames than the audio has, {empty} with an empty transcript", stacklevel=2)
    if not kept:
        raise UserError(f"asr: no {split} utterance is left to use (see the warning above).")
    return kept


def example_batch(dataset: Utterances | SyntheticUtterances, batch_seconds: float) -> Batch:
    """A batch of median padded length, as duration buckets form them."""
    durations = dataset.durations()
    batches = sorted(bucket_batches(durations, batch_seconds, seed=0),
                     key=lambda b: max(durations[i] for i in b))
    return collate_utterances([dataset[i] for i in batches[len(batches) // 2]])


def build(data_dir: str | None = None, data: str = "real", model_size: str | None = None,
          val_speakers: str | None = None, batch_seconds: float | None = None,
          max_audio_seconds: float | None = None) -> Workload:
    """The `asr` workload: a conformer CTC recogniser on transcribed audio."""
    size = model_size or DEFAULT_MODEL_SIZE
    if size not in MODEL_SIZES:
        raise UserError(f"asr: unknown --model-size {model_size!r}; choose one of "
                        f"{', '.join(MODEL_SIZES)} (default {DEFAULT_MODEL_SIZE}).")
    if data not in ("real", "synthetic"):
        raise UserError(f"asr: --data must be real or synthetic (got {data!r}).")
    if data_dir is None and data == "real":
        raise UserError("asr reads --data-dir DIR: a manifest.jsonl (or train.jsonl and "
                        "val.jsonl), or audio files with .txt transcripts beside them. "
                        "Build one with `python scripts/connected_digits.py --out DIR`.")
    budget = DEFAULT_BATCH_SECONDS if batch_seconds is None else batch_seconds
    longest = DEFAULT_MAX_AUDIO_SECONDS if max_audio_seconds is None else max_audio_seconds
    if budget <= 0 or longest <= 0:
        raise UserError(f"asr: --batch-seconds ({budget:g}) and --max-audio-seconds "
                        f"({longest:g}) must be positive numbers of seconds.")
    if data == "synthetic":
        train, val = (SyntheticUtterances(count, seed, SAMPLE_RATE)
                      for count, seed in zip(SYNTHETIC_COUNTS, (1, 2), strict=True))
        vocabulary = train.vocabulary
        model = ConformerCTC(len(vocabulary), sample_rate=SAMPLE_RATE, **MODEL_SIZES[size])
    else:
        assert data_dir is not None
        model, train, val = _read(data_dir, val_speakers, size, longest)
        vocabulary = train.vocabulary
    return Workload(
        name="asr",
        model=model,
        train_dataset=train,
        val_dataset=val,
        loss_fn=ctc_loss,
        loss_units=target_characters,
        metrics={"wer": partial(error_metric, vocabulary, "word"),
                 "cer": partial(error_metric, vocabulary, "char")},
        collate_fn=collate_utterances,
        example_batch=example_batch(train, budget),
        serving=asr_serving(vocabulary, SAMPLE_RATE, longest),
        augment=WaveAugment(sample_rate=SAMPLE_RATE, speed=SPEED),
        default_epochs=DEFAULT_EPOCHS,
        batch_sampler=partial(_buckets, train.durations(), budget),
        padding=padding,
    )


def _read(data_dir: str, val_speakers: str | None, size: str,
          longest: float) -> tuple[ConformerCTC, Utterances, Utterances]:
    """The model and the usable training and validation utterances of ``data_dir``."""
    train_utts, val_utts = load_splits(data_dir, val_speakers)
    vocabulary = Vocabulary.from_texts(u.text for u in train_utts)
    unheard = set().union(*(vocabulary.unknown(u.text) for u in val_utts))
    if unheard:
        warnings.warn(f"asr: validation transcripts hold characters no training transcript "
                      f"has ({''.join(sorted(unheard))}); the model cannot write them",
                      stacklevel=2)
    model = ConformerCTC(len(vocabulary), sample_rate=SAMPLE_RATE, **MODEL_SIZES[size])
    train = Utterances(alignable(train_utts, vocabulary, model, longest, "training"),
                       vocabulary)
    val = sorted(alignable(val_utts, vocabulary, model, longest, "validation"),
                 key=lambda u: u.duration)  # evaluation batches of alike lengths
    return model, train, Utterances(val, vocabulary)


def _buckets(durations: list[float], budget: float, seed: int, rank: int,
             world_size: int) -> DurationBuckets:
    return DurationBuckets(durations, budget, seed, rank, world_size)

