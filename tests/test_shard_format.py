"""The packed-set format: records and shard files byte for byte as version 1 wrote them (and
version 2 writes them, with its manifest's token width), version 1 sets read back as before,
and damage named with its fix."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from packed_sets import leaves, write_id_set, write_records

from gpuflow.data.kinds import TensorRecords, TokenWindows, kind_of
from gpuflow.data.manifest import Manifest, load_manifest, write_manifest
from gpuflow.data.reader import SplitReader
from gpuflow.data.record_codec import decode_record, layout_of
from gpuflow.data.shard_files import RecordShard, write_token_shard
from gpuflow.data.streaming import open_packed
from gpuflow.errors import UserError

INT64 = 4  # dtype code of torch.int64 in a record


def version_1_record_shard(values: list[int]) -> bytes:
    """A shard of records ``(tensor([v]), v)`` built from the documented layout alone:
    ``GFSHARD1 | records | index | trailer``, each record a u32 length and its leaves as
    dtype code (u8), rank (u8), shape (u64 each) and raw bytes."""
    records = [struct.pack("<BBQq", INT64, 1, 1, v) + struct.pack("<BBq", INT64, 0, v)
               for v in values]
    body, offsets = b"GFSHARD1", []
    for record in records:
        offsets.append(len(body))
        body += struct.pack("<I", len(record)) + record
    index = struct.pack(f"<{len(offsets)}Q", *offsets)
    return body + index + struct.pack("<QQ8s", len(records), len(body), b"GFSHARD1")


# manifest.json as format version 1 wrote it for a set of two such records (its sha256 is
# the shard's above, its key order the writer's).
VERSION_1_MANIFEST = """{
 "format": "gpuflow-shards",
 "format_version": 1,
 "workload": "ids",
 "kind": "records",
 "splits": {
  "train": [
   {
    "file": "train-00000.rec",
    "bytes": 112,
    "sha256": "6813d5a6b412d91494b9b6f049f31e4fb12deb1795a648459ba713776ec834b0",
    "count": 2
   }
  ]
 },
 "layout": [
  "t",
  "i"
 ],
 "example": null,
 "example_layout": null,
 "meta": {},
 "source": null,
 "shard_bytes": 0,
 "counts": {
  "train": 2
 }
}
"""
# Version 2 writes the same shards; its manifest adds the width of token shards' tokens.
VERSION_2_MANIFEST = VERSION_1_MANIFEST.replace(
    '"format_version": 1', '"format_version": 2').replace(
    ' "shard_bytes": 0,\n', ' "shard_bytes": 0,\n "token_dtype": "uint8",\n')
assert VERSION_2_MANIFEST.count('"format_version": 2') == VERSION_2_MANIFEST.count(
    '"token_dtype": "uint8",') == 1


def test_writers_write_version_2_bytes(tmp_path: Path) -> None:
    info = write_records(tmp_path / TensorRecords.shard_name("train", 0),
                         [(torch.tensor([value]), value) for value in (0, 1)])
    assert (tmp_path / "train-00000.rec").read_bytes() == version_1_record_shard([0, 1])
    write_manifest(tmp_path, Manifest(workload="ids", kind=TensorRecords.name,
                                      splits={"train": [info]},
                                      layout=layout_of((torch.tensor([0]), 0))))
    assert (tmp_path / "manifest.json").read_text() == VERSION_2_MANIFEST
    tokens = write_token_shard(tmp_path / TokenWindows.shard_name("train", 0),
                               np.arange(5, dtype=np.uint8))
    header = (b"\x93NUMPY\x01\x00v\x00{'descr': '|u1', 'fortran_order': False, "
              b"'shape': (5,), }").ljust(127) + b"\n"
    assert (tmp_path / "train-00000.npy").read_bytes() == header + bytes(range(5))
    assert (tokens.bytes, tokens.count) == (133, 5)
    wide = write_token_shard(tmp_path / "wide.npy", np.array([1, 70_000]), np.dtype("<u4"))
    assert (tmp_path / "wide.npy").read_bytes() == header.replace(b"|u1", b"<u4").replace(
        b"(5,)", b"(2,)") + (1).to_bytes(4, "little") + (70_000).to_bytes(4, "little")
    assert (wide.bytes, wide.count) == (136, 2)


def test_a_version_1_set_reads_as_it_was_written(tmp_path: Path) -> None:
    (tmp_path / "train-00000.rec").write_bytes(version_1_record_shard([7, 9]))
    manifest = json.loads(VERSION_1_MANIFEST)
    shard = manifest["splits"]["train"][0]
    shard["sha256"] = hashlib.sha256((tmp_path / "train-00000.rec").read_bytes()).hexdigest()
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    loaded = load_manifest(tmp_path)
    reader = SplitReader(tmp_path, loaded, "train")
    assert isinstance(reader.kind, TensorRecords) and len(reader) == 2
    tensor, value = reader[1]
    assert torch.equal(tensor, torch.tensor([9])) and value == 9 and type(value) is int
    batch = reader.collated([0, 1])
    assert torch.equal(batch[0], torch.tensor([[7], [9]])) and batch[1].tolist() == [7, 9]


def test_the_kind_is_chosen_once_from_the_manifest() -> None:
    records = Manifest(workload="w", kind="records", splits={}, layout=["t", "i"])
    assert isinstance(kind_of(records), TensorRecords)
    tokens = Manifest(workload="w", kind="tokens", splits={})
    windows = kind_of(tokens, seq_len=4)
    assert isinstance(windows, TokenWindows) and windows.seq_len == 4
    with pytest.raises(ValueError, match="sequence length"):
        kind_of(tokens)
    with pytest.raises(UserError, match="kind 'frames' is unknown.*Upgrade gpuflow"):
        kind_of(Manifest(workload="w", kind="frames", splits={}))


def test_record_round_trip_keeps_dtypes_shapes_and_nesting(tmp_path: Path) -> None:
    items = [
        ((torch.randn(3, 5), torch.tensor(7)), 4),
        (torch.arange(6, dtype=torch.int16).reshape(2, 3), torch.zeros(0), 0.1),
        (torch.randn(4).to(torch.bfloat16), torch.tensor([True, False])),
    ]
    info = write_records(tmp_path / "a.rec", items)
    assert info.count == 3 and info.bytes == (tmp_path / "a.rec").stat().st_size
    shard = RecordShard(tmp_path / "a.rec")
    for index, item in enumerate(items):
        back = decode_record(shard.read(index), layout_of(item))
        for a, b in zip(leaves(item), leaves(back), strict=True):
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b)
            else:
                assert type(a) is type(b) and a == b
    shard.close()
    assert not list(tmp_path.glob(".*.tmp"))


def test_corrupt_or_truncated_shards_are_named_with_the_fix(tmp_path: Path) -> None:
    out = tmp_path / "ids"
    write_id_set(out, [50, 50])
    shard = out / "train-00001.rec"
    data = bytearray(shard.read_bytes())
    data[40] ^= 0xFF
    shard.write_bytes(bytes(data))
    packed = open_packed(out, "ids")  # sizes are intact: opening succeeds
    assert packed is not None
    assert int(packed.train[10][1]) == 10
    with pytest.raises(UserError, match=r"train-00001\.rec fails its checksum.*--force"):
        packed.train[60]
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(UserError, match=r"train-00001\.rec holds \d+ bytes, the manifest"):
        open_packed(out, "ids")
