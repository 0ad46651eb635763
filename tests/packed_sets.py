"""Small packed sets for the tests of gpuflow.data's shards, packing and streaming."""

from __future__ import annotations

from pathlib import Path

import torch

from gpuflow.data.manifest import Manifest, ShardInfo, write_manifest
from gpuflow.data.record_codec import encode_record, layout_of
from gpuflow.data.shard_files import RecordShardWriter
from gpuflow.workloads.packing import pack

SMALL_SHARDS_MB = 0.05  # digits: 9 train shards of ~178 samples


def write_records(path: Path, items: list) -> ShardInfo:
    """One record shard holding ``items``, in order."""
    writer = RecordShardWriter(path)
    for item in items:
        writer.write(encode_record(item))
    return writer.close()


def write_id_set(directory: Path, counts: list[int]) -> None:
    """A record set whose sample i is ``(tensor([i]), i)``, in shards of the given sizes."""
    directory.mkdir(parents=True)
    infos, sample = [], 0
    for number, count in enumerate(counts):
        infos.append(write_records(directory / f"train-{number:05d}.rec",
                                   [(torch.tensor([i]), i) for i in range(sample, sample + count)]))
        sample += count
    write_manifest(directory, Manifest(workload="ids", kind="records", splits={"train": infos},
                                       layout=layout_of((torch.tensor([0]), 0))))


def leaves(item: object) -> list:
    if isinstance(item, tuple | list):
        return [leaf for part in item for leaf in leaves(part)]
    return [item]


def pack_small_digits(folder: Path) -> Path:
    """Digits packed in shards of ``SMALL_SHARDS_MB``: 9 train shards."""
    out = folder / "digits"
    pack("digits", None, out, shard_mb=SMALL_SHARDS_MB, progress=False)
    return out
