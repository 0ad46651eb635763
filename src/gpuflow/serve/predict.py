"""Offline batch prediction over files, folders and packed sets, resumable, with the loader
in workers.

Each input file becomes one JSON line ``{"input": PATH, "predictions": [...]}`` (or
``"error"`` for a file the model cannot take); each sample of a packed set (``gpuflow data
pack``) one line ``{"input": "DIR#SPLIT:INDEX", "predictions": [...], "target": ...}``.
Lines are appended only after their batch has run, so an interrupted run resumes by
skipping the inputs already in the output file. Inputs are read and decoded in DataLoader
worker processes; the model runs in this process, on batches of inputs that share a
batching key (e.g. the same padded length).
"""

from __future__ import annotations

import json
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.utils.data import DataLoader, Dataset

from gpuflow.errors import UserError
from gpuflow.serve.engine import Engine
from gpuflow.serving import Codec, Decoded, InputError, PredictRequest


@dataclass(frozen=True)
class PackedSample:
    """One sample of a packed set, named ``DIR#SPLIT:INDEX`` in the output."""

    directory: Path
    split: str
    index: int

    def __str__(self) -> str:
        return f"{self.directory}#{self.split}:{self.index}"


Input = Path | PackedSample


def _packed_samples(directory: Path, seq_len: int | None) -> list[PackedSample]:
    from gpuflow.data.manifest import load_manifest
    from gpuflow.data.reader import SplitReader

    manifest = load_manifest(directory)
    return [PackedSample(directory, split, index) for split in sorted(manifest.splits)
            for index in range(len(SplitReader(directory, manifest, split, seq_len)))]


def collect_inputs(inputs: Iterable[str], suffixes: tuple[str, ...],
                   seq_len: int | None = None) -> list[Input]:
    """Files as given, the files under folders whose suffix the model can read, and every
    sample of each packed set (token sets cut into windows of ``seq_len``)."""
    from gpuflow.data.manifest import is_packed

    found: list[Input] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir() and is_packed(path):
            found += _packed_samples(path, seq_len)
        elif path.is_dir():
            found += sorted(p for p in path.rglob("*")
                            if p.is_file() and p.suffix.lower() in suffixes)
        elif path.is_file():
            found.append(path)
        else:
            raise UserError(f"Input {item} does not exist.")
    return list(dict.fromkeys(found))


def finished_inputs(out: Path) -> set[str]:
    """Inputs already in ``out``; a torn last line (killed mid-write) is cut off."""
    if not out.is_file():
        return set()
    data = out.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with out.open("r+b") as handle:
            handle.truncate(len(complete))
    done = set()
    for line in complete.splitlines():
        try:
            done.add(json.loads(line)["input"])
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{out} has a line that is not a prediction: {line[:80]!r}. "
                            "Give another --out file.") from None
    return done


class _Files(Dataset):
    """Decodes one input per item in a loader worker:
    ``(name, Decoded | error message, target or None)``."""

    def __init__(self, paths: list[Input], codec: Codec, defaults: dict[str, Any],
                 seq_len: int | None) -> None:
        self.paths, self.codec, self.defaults, self.seq_len = paths, codec, defaults, seq_len
        self._readers: dict[tuple[Path, str], Any] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[str, Decoded | str, Any]:
        path = self.paths[index]
        try:
            if isinstance(path, PackedSample):
                inputs, target = self._reader(path)[path.index]
                return (str(path), self.codec.from_sample(inputs, self.defaults),
                        target.tolist() if isinstance(target, torch.Tensor) else target)
            return str(path), self.codec.decode_file(path, self.defaults), None
        except InputError as exc:
            return str(path), str(exc), None

    def _reader(self, sample: PackedSample) -> Any:
        """The split's reader, opened once per worker process."""
        from gpuflow.data.manifest import load_manifest
        from gpuflow.data.reader import SplitReader

        key = (sample.directory, sample.split)
        if key not in self._readers:
            self._readers[key] = SplitReader(sample.directory, load_manifest(sample.directory),
                                             sample.split, self.seq_len)
        return self._readers[key]


def _as_is(item: Any) -> Any:
    return item


@dataclass(frozen=True)
class PredictStats:
    files: int
    skipped: int
    failed: int
    rows: int
    seconds: float


def predict_files(engine: Engine, paths: list[Input], out: Path, *, num_workers: int = 2,
                  defaults: dict[str, Any] | None = None,
                  progress: bool = True) -> PredictStats:
    """Predict every path not yet in ``out`` and append one line per file."""
    defaults = defaults or {}
    request = PredictRequest(**defaults)
    done = finished_inputs(out)
    todo = [p for p in paths if str(p) not in done]
    seq_len = getattr(engine.codec, "seq_len", None)
    loader = DataLoader(_Files(todo, engine.codec, defaults, seq_len), batch_size=None,
                        num_workers=num_workers, collate_fn=_as_is)
    groups: dict[Hashable, list[tuple[str, Decoded, Any]]] = {}
    failed = rows = 0
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = Progress(TextColumn("predict"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
                   disable=not progress)
    with out.open("a", encoding="utf-8") as sink, bar:
        task = bar.add_task("predict", total=len(todo), rate="")
        written = [0]

        def write(lines: list[dict[str, Any]]) -> None:
            sink.write("".join(json.dumps(line) + "\n" for line in lines))
            sink.flush()
            written[0] += len(lines)
            rate = written[0] / max(time.perf_counter() - start, 1e-9)
            bar.update(task, completed=written[0], rate=f"{rate:.1f} files/s")

        def flush(key: Hashable) -> None:
            nonlocal rows
            files = groups.pop(key)
            batch = [row for _, decoded, _ in files for row in decoded.rows]
            outputs = iter(engine.run(key, batch))
            rows += len(batch)
            write([{"input": path,
                    "predictions": [engine.codec.format(next(outputs), request)
                                    for _ in decoded.rows],
                    **({} if target is None else {"target": target})}
                   for path, decoded, target in files])

        for path, decoded, target in loader:
            if isinstance(decoded, str):
                failed += 1
                write([{"input": path, "error": decoded}])
                continue
            group = groups.setdefault(decoded.key, [])
            group.append((path, decoded, target))
            if sum(len(d.rows) for _, d, _ in group) >= engine.options.max_batch_size:
                flush(decoded.key)
        for key in list(groups):
            flush(key)
    return PredictStats(len(todo), len(paths) - len(todo), failed, rows,
                        time.perf_counter() - start)
