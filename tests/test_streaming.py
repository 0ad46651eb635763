"""Streaming a packed set: the epoch order, ranks and workers, batched decoding, exact resume,
and bounded memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import runs
import torch
from conftest import ROOT, cli_env, run_cli
from packed_sets import SMALL_SHARDS_MB, leaves, write_id_set, write_records
from torch.utils.data import DataLoader, default_collate, get_worker_info

from gpuflow import checkpoint as ckpt
from gpuflow.cli import main
from gpuflow.data.loader import batches_per_epoch, train_batches
from gpuflow.data.manifest import Manifest, load_manifest, write_manifest
from gpuflow.data.reader import SplitReader
from gpuflow.data.record_codec import layout_of
from gpuflow.data.shard_files import write_token_shard
from gpuflow.data.streaming import epoch_order, open_packed


def ids_of(batches: list) -> list[list[int]]:
    return [batch[1].tolist() for batch in batches]


def test_epoch_order_is_a_seeded_permutation_that_changes_each_epoch() -> None:
    counts = [40, 7, 33, 0, 20]
    orders = [list(epoch_order(counts, seed=3, epoch=e, buffer_size=16)) for e in range(3)]
    for order in orders:
        assert sorted(order) == list(range(100))
    assert len({tuple(order) for order in orders}) == 3
    assert orders[1] == list(epoch_order(counts, seed=3, epoch=1, buffer_size=16))
    assert orders[0] != list(epoch_order(counts, seed=4, epoch=0, buffer_size=16))


def tagged_collate(items: list) -> tuple:
    """A batch and the loader worker that built it."""
    info = get_worker_info()
    return (*default_collate(items), -1 if info is None else info.id)


def test_ranks_and_workers_partition_each_epoch_and_resume_exactly(tmp_path: Path) -> None:
    out = tmp_path / "ids"
    write_id_set(out, [37, 50, 23, 41, 52])  # 203 samples
    data = open_packed(out, "ids")
    assert data is not None
    dataset, batch, world = data.train, 8, 2
    assert sorted(int(item[1]) for item in dataset) == list(range(203))  # plain iteration
    per_epoch = batches_per_epoch(dataset, batch, world)
    assert per_epoch == 12  # 203 // 2 // 8: 192 samples per epoch, 11 dropped

    def stream(rank: int, start: int, workers: int, count: int) -> list:
        source = dataset.batches(seed=5, batch_size=batch, per_epoch=per_epoch,
                                 start_batch=start, collate=tagged_collate, rank=rank,
                                 world_size=world)
        loader = iter(DataLoader(source, batch_size=None, num_workers=workers))
        return [next(loader) for _ in range(count)]

    epochs = {rank: stream(rank, 0, 0, 2 * per_epoch) for rank in range(world)}
    for epoch in range(2):
        seen = [i for rank in range(world)
                for ids in ids_of(epochs[rank][epoch * per_epoch:(epoch + 1) * per_epoch])
                for i in ids]
        assert len(seen) == len(set(seen)) == per_epoch * batch * world
    first = {i for ids in ids_of(epochs[0][:per_epoch]) for i in ids}
    second = {i for ids in ids_of(epochs[0][per_epoch:]) for i in ids}
    assert ids_of(epochs[0][:per_epoch]) != ids_of(epochs[0][per_epoch:]) and first != second

    resumed = stream(1, per_epoch - 3, 2, 6)  # mid-epoch 0, into epoch 1, two workers
    assert ids_of(resumed) == ids_of(epochs[1][per_epoch - 3:per_epoch + 3])
    assert [b[2] for b in resumed] == [0, 1, 0, 1, 0, 1]  # each worker built every other


def test_train_batches_streams_packed_sets_like_any_dataset(packed_digits: Path) -> None:
    data = open_packed(packed_digits, "digits")
    assert data is not None
    common = dict(batch_size=32, collate=default_collate, seed=1, pin_memory=False)
    whole = train_batches(data.train, start_batch=0, num_workers=0, **common)
    reference = [next(whole) for _ in range(50)]  # crosses the epoch boundary at 44
    later = train_batches(data.train, start_batch=41, num_workers=2, **common)
    for expected in reference[41:]:
        got = next(later)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_batched_decoding_gives_the_default_collates_batches(packed_digits: Path,
                                                            tmp_path: Path) -> None:
    data = open_packed(packed_digits, "digits")
    assert data is not None
    common = dict(batch_size=32, collate=default_collate, seed=1, pin_memory=False,
                  start_batch=40, num_workers=0)
    per_item = train_batches(data.train, **common)
    batched = train_batches(data.train, batched_indexing=True, **common)
    for _ in range(8):  # across the epoch boundary at 44
        expected, got = next(per_item), next(batched)
        assert type(got) is type(expected)
        assert all(a.dtype == b.dtype and torch.equal(a, b)
                   for a, b in zip(got, expected, strict=True))
    # records whose shapes differ are decoded one by one and meet default_collate's verdict
    items = [(torch.randn(n, 2), (n, 0.5 * n, n % 2 == 0)) for n in (3, 3, 5)]
    shard = write_records(tmp_path / "train-00000.rec", items)
    write_manifest(tmp_path, Manifest(workload="w", kind="records", layout=layout_of(items[0]),
                                      splits={"train": [shard]}))
    reader = SplitReader(tmp_path, load_manifest(tmp_path), "train")
    expected = default_collate([reader[i] for i in (1, 0)])
    got = reader.collated([1, 0])
    assert all(a.dtype == b.dtype and torch.equal(a, b)
               for a, b in zip(leaves(got), leaves(expected), strict=True))
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        reader.collated([2, 0])
    # token windows
    text = tmp_path / "text"
    text.mkdir()
    shard = write_token_shard(text / "train-00000.npy", np.arange(40, dtype=np.uint8))
    write_manifest(text, Manifest(workload="w", kind="tokens", splits={"train": [shard]}))
    windows = SplitReader(text, load_manifest(text), "train", seq_len=4)
    expected = default_collate([windows[i] for i in (3, 0, 7)])
    got = windows.collated([3, 0, 7])
    assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(got, expected, strict=True))


def test_train_from_packed_digits_and_resume_reproduces_the_run(tmp_path: Path) -> None:
    packed = tmp_path / "packed"
    result = run_cli("data", "pack", "--out", str(packed), "--workload", "digits",
                     "--shard-size-mb", str(SMALL_SHARDS_MB))
    assert result.returncode == 0, result.stderr
    assert "train 1,438 samples in 9 shard(s)" in result.stdout
    run_dir = tmp_path / "run"
    assert main(["train", "--workload", "digits", "--data-dir", str(packed), "--max-steps",
                 "30", "--checkpoint-every", "10", "--eval-every", "0", "--batch-size", "64",
                 "--run-dir", str(run_dir), "--no-progress"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_metrics"]["val_accuracy"] > 0.5
    final = runs.newest_weights(run_dir)
    losses = runs.losses(run_dir)

    # As if killed after the step-10 checkpoint (an epoch is 22 steps): resume with two
    # loader workers.
    later = ckpt.list_checkpoints(run_dir / "checkpoints")[:2]
    assert [checkpoint.step for checkpoint in later] == [30, 20]
    for checkpoint in later:
        shutil.rmtree(checkpoint.path)
    (run_dir / "summary.json").unlink()
    assert main(["train", "--resume", str(run_dir), "--num-workers", "2",
                 "--no-progress"]) == 0
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["final_metrics"] == summary["final_metrics"]
    again = runs.newest_weights(run_dir)
    assert all(torch.equal(final[name], again[name]) for name in final)
    assert runs.losses(run_dir) == losses


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import numpy as np
    import torch
    from torch.nn import Linear

    import gpuflow
    from gpuflow.data.loader import batches_per_epoch, train_batches
    from gpuflow.workloads.packing import pack
    from gpuflow.data.manifest import Manifest, write_manifest
    from gpuflow.data.shard_files import write_token_shard
    from gpuflow.data.streaming import open_packed

    ITEM = 16_384  # float32 values: 64 KiB per record
    COUNT = int(sys.argv[2]) * 2**20 // (4 * ITEM)
    TOKEN_SHARD = 2 * 2**20

    class Lazy(torch.utils.data.Dataset):
        # Records made on demand: the set never exists in memory, only on disk.
        def __len__(self):
            return COUNT
        def __getitem__(self, index):
            return torch.full((ITEM,), float(index)), index % 10

    def build():
        return gpuflow.Workload(name="big", model=Linear(ITEM, 10), train_dataset=Lazy())

    def peak_rss():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    root = Path(sys.argv[1])
    torch.full((ITEM,), 0.0) + 1
    baseline = peak_rss()
    pack("__main__:build", None, root / "records", shard_mb=4, progress=False)
    tokens = root / "tokens"
    tokens.mkdir()
    shards = [write_token_shard(tokens / f"train-{n:05d}.npy",
                                np.full(TOKEN_SHARD, n, dtype=np.uint8))
              for n in range(int(sys.argv[3]) * 2**20 // TOKEN_SHARD)]
    write_manifest(tokens, Manifest(workload="text", kind="tokens", splits={"train": shards}))
    streamed = {}
    for name, seq_len in (("records", None), ("text", 2048)):
        folder = root / ("records" if seq_len is None else "tokens")
        train = open_packed(folder, "big" if seq_len is None else "text", seq_len).train
        per_epoch = batches_per_epoch(train, 16)
        batches = train_batches(train, 16, torch.utils.data.default_collate, 0, 0, 0, False)
        for _ in range(2 * per_epoch):
            inputs, _ = next(batches)
            streamed[name] = streamed.get(name, 0) + inputs.numel() * (4 if seq_len is None else 1)
    print(json.dumps({"growth": peak_rss() - baseline, "streamed": streamed}))
""")


def test_streaming_memory_stays_bounded_far_below_the_data_size(tmp_path: Path) -> None:
    """A 192 MiB record set is packed and streamed for two epochs, then a 32 MiB token set
    (2 MiB shards) too; the process's peak RSS may grow by at most 48 MiB, a quarter of the
    record set, and far less than the 448 MiB that passed through it."""
    records_mb, tokens_mb, cap = 192, 32, 48 * 2**20
    script = tmp_path / "stream.py"
    script.write_text(MEMORY_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tmp_path), str(records_mb),
                             str(tokens_mb)],
                            capture_output=True, text=True, timeout=300, env=cli_env(),
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["streamed"]["records"] == 2 * records_mb * 2**20
    assert figures["streamed"]["text"] >= 2 * tokens_mb * 2**20 * 0.99
    assert figures["growth"] < cap, figures


