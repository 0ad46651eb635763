"""Workloads whose data is a stream (an IterableDataset), as a user would write them."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import IterableDataset

import gpuflow

FEATURES, CLASSES = 4, 3


def features_of(ids: torch.Tensor) -> torch.Tensor:
    """Bounded features of a sample id: the counter itself would grow without limit."""
    angles = ids.double().unsqueeze(-1) * torch.arange(1, FEATURES + 1, dtype=torch.float64)
    return torch.sin(angles).float()


class Counter(IterableDataset):
    """Sample i is ``((features, i), i % 3)`` for i = 0, 1, 2, ... without end (no length)."""

    def __iter__(self) -> Iterator[tuple[tuple[torch.Tensor, torch.Tensor], int]]:
        i = 0
        while True:
            ids = torch.tensor(i)
            yield (features_of(ids), ids), i % CLASSES
            i += 1


class RecordingModel(nn.Module):
    """A linear classifier that appends the ids it trains on to $SEEN_DIR/seen-$RANK.txt."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(FEATURES, CLASSES)
        seen = os.environ.get("SEEN_DIR")
        self.log = Path(seen) / f"seen-{os.environ.get('RANK', '0')}.txt" if seen else None

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.log is not None and self.training and not is_fake(ids):
            with open(self.log, "a") as handle:
                handle.write(" ".join(map(str, ids.tolist())) + "\n")
        return self.head(x)


def endless_counter() -> gpuflow.Workload:
    example_ids = -torch.arange(1, 5)  # never a training id
    return gpuflow.Workload(name="counter", model=RecordingModel(), train_dataset=Counter(),
                            example_batch=((features_of(example_ids), example_ids),
                                           torch.zeros(4, dtype=torch.int64)))


def write_jsonl_shards(folder: Path, shards: int, rows: int) -> None:
    """``shards`` JSON-lines files of ``rows`` rows each: features and a class."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    for shard in range(shards):
        labels = torch.randint(0, CLASSES, (rows,), generator=generator)
        x = torch.randn(rows, FEATURES, generator=generator) + labels.unsqueeze(1)
        lines = [json.dumps({"x": row.tolist(), "y": int(label)})
                 for row, label in zip(x, labels, strict=True)]
        (folder / f"part-{shard:03d}.jsonl").write_text("\n".join(lines) + "\n")


class Gate:
    """Blocks every collate once the checkpoint named by $GATE_CHECKPOINT exists, so a
    test can SIGKILL the run at a known point after that checkpoint."""

    def __init__(self) -> None:
        gate = os.environ.get("GATE_CHECKPOINT")
        self.gate = Path(gate) if gate else None

    def __call__(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        while self.gate is not None and self.gate.exists():
            time.sleep(0.05)
        return (torch.tensor([row["x"] for row in rows]),
                torch.tensor([row["y"] for row in rows]))


def hf_stream(data_dir: str) -> gpuflow.Workload:
    """A Hugging Face ``datasets`` streaming dataset read from local JSON-lines files."""
    from datasets import load_dataset

    files = sorted(str(path) for path in Path(data_dir).glob("*.jsonl"))
    stream = load_dataset("json", data_files=files, split="train", streaming=True)
    return gpuflow.Workload(name="hf-stream", model=nn.Linear(FEATURES, CLASSES),
                            train_dataset=stream, collate_fn=Gate())
