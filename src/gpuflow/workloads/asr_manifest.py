"""Where the `asr` workload finds its utterances: NeMo-style JSONL manifests, or audio files
with a ``.txt`` transcript beside each.

A manifest line is ``{"audio_filepath": ..., "text": ..., "duration": seconds}``, with an
optional ``"speaker"``; a relative path is read from the manifest's folder, and a missing
duration from the file's header. A line that does not parse or names a missing file stops
the run, naming the manifest and the line.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuflow.data.audio_file import audio_seconds
from gpuflow.errors import UserError

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".opus", ".mp3")
MANIFEST = "manifest.jsonl"
SPLIT_MANIFESTS = ("train.jsonl", "val.jsonl")
VAL_SHARE = 10  # without speakers, every VAL_SHARE-th utterance validates


@dataclass(frozen=True)
class Utterance:
    path: Path
    duration: float
    text: str
    speaker: str | None = None


def read_manifest(manifest: Path) -> list[Utterance]:
    """The utterances a JSONL manifest lists, in its order."""
    utterances = []
    for number, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            utterances.append(_parse_line(manifest, number, line))
    if not utterances:
        raise UserError(f"{manifest} lists no utterances; write one JSON object a line with "
                        "audio_filepath, text and duration.")
    return utterances


def _parse_line(manifest: Path, number: int, line: str) -> Utterance:
    where = f"{manifest}, line {number}"
    try:
        entry = json.loads(line)
        path, text = Path(entry["audio_filepath"]), str(entry["text"])
        duration = entry.get("duration")
        speaker = entry.get("speaker")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{where} is not a manifest entry ({type(exc).__name__}: {exc}); "
                        'write {"audio_filepath": "a.wav", "text": "...", "duration": 1.5}.'
                        ) from None
    path = path if path.is_absolute() else manifest.parent / path
    if not path.is_file():
        raise UserError(f"{where} names {path}, which does not exist; fix the path (a "
                        "relative one is read from the manifest's folder) or drop the line.")
    try:
        seconds = float(duration) if duration is not None else audio_seconds(path)
    except (TypeError, ValueError):
        raise UserError(f"{where}: duration {duration!r} is not a number of seconds.") from None
    return Utterance(path, seconds, text, None if speaker is None else str(speaker))


def find_transcribed(folder: Path) -> list[Utterance]:
    """Audio files under ``folder`` with a ``.txt`` transcript of the same name beside them."""
    found, bare = [], 0
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() not in AUDIO_SUFFIXES or not path.is_file():
            continue
        transcript = path.with_suffix(".txt")
        if transcript.is_file():
            found.append(Utterance(path, audio_seconds(path),
                                   transcript.read_text(encoding="utf-8").strip()))
        else:
            bare += 1
    if bare:
        warnings.warn(f"asr: ignored {bare} audio file(s) in {folder} without a .txt "
                      "transcript beside them", stacklevel=2)
    return found


def load_splits(data_dir: str | Path, val_speakers: str | None = None
                ) -> tuple[list[Utterance], list[Utterance]]:
    """Training and validation utterances (see docs/workloads/asr.md for the rule)."""
    folder = Path(data_dir)
    if not folder.is_dir():
        raise UserError(f"--data-dir {folder} is not a folder.")
    train_file, val_file = (folder / name for name in SPLIT_MANIFESTS)
    if train_file.is_file() and val_file.is_file():
        return read_manifest(train_file), read_manifest(val_file)
    manifest = folder / MANIFEST
    utterances = read_manifest(manifest) if manifest.is_file() else find_transcribed(folder)
    if not utterances:
        raise UserError(
            f"--data-dir {folder} holds no {MANIFEST}, no {' and '.join(SPLIT_MANIFESTS)}, "
            f"and no audio files ({', '.join(AUDIO_SUFFIXES)}) with .txt transcripts beside "
            "them. Build a connected-digit set with `python scripts/connected_digits.py`.")
    return split_utterances(utterances, val_speakers, folder)


def split_utterances(utterances: Sequence[Utterance], val_speakers: str | None,
                     folder: Path) -> tuple[list[Utterance], list[Utterance]]:
    """Whole speakers held out (``val_speakers``, else the last by name) where every line
    names one; otherwise every ``VAL_SHARE``-th utterance."""
    speakers = sorted({u.speaker for u in utterances if u.speaker is not None})
    if not speakers or any(u.speaker is None for u in utterances):
        if val_speakers is not None:
            raise UserError(f"--val-speakers needs a speaker on every manifest line in "
                            f"{folder}; add \"speaker\" fields or drop the flag.")
        return ([u for i, u in enumerate(utterances) if i % VAL_SHARE != VAL_SHARE - 1],
                [u for i, u in enumerate(utterances) if i % VAL_SHARE == VAL_SHARE - 1])
    held = ([name.strip() for name in val_speakers.split(",") if name.strip()]
            if val_speakers is not None else speakers[-1:])
    unknown = sorted(set(held) - set(speakers))
    if unknown or not held or set(held) >= set(speakers):
        raise UserError(
            f"--val-speakers {val_speakers!r} must name some, not all, of the speakers in "
            f"{folder}: {', '.join(speakers)}"
            + (f" ({', '.join(unknown)} not among them)." if unknown else "."))
    return ([u for u in utterances if u.speaker not in held],
            [u for u in utterances if u.speaker in held])
