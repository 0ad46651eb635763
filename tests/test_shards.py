"""Packed sets: the shard format, packing, streaming order and resume, and bounded memory."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, cli_env, run_cli
from safetensors.torch import load_file
from torch.utils.data import DataLoader, default_collate, get_worker_info

from gpuflow import checkpoint as ckpt
from gpuflow.cli import main
from gpuflow.data import pack_sources
from gpuflow.data.loader import batches_per_epoch, train_batches
from gpuflow.data.manifest import Manifest, load_manifest, write_manifest
from gpuflow.data.reader import SplitReader
from gpuflow.data.record_codec import decode_record, encode_record, layout_of
from gpuflow.data.shard_files import RecordShard, RecordShardWriter, write_token_shard
from gpuflow.data.streaming import epoch_order, open_packed
from gpuflow.errors import UserError
from gpuflow.workloads import digits
from gpuflow.workloads.packing import pack

SMALL_SHARDS_MB = 0.05  # digits: 9 train shards of ~178 samples


def write_id_set(directory: Path, counts: list[int]) -> None:
    """A record set whose sample i is ``(tensor([i]), i)``, in shards of the given sizes."""
    directory.mkdir(parents=True)
    infos, sample = [], 0
    for number, count in enumerate(counts):
        writer = RecordShardWriter(directory / f"train-{number:05d}.rec")
        for _ in range(count):
            writer.write(encode_record((torch.tensor([sample]), sample)))
            sample += 1
        infos.append(writer.close())
    write_manifest(directory, Manifest(workload="ids", kind="records", splits={"train": infos},
                                       layout=layout_of((torch.tensor([0]), 0))))


def leaves(item: object) -> list:
    if isinstance(item, tuple | list):
        return [leaf for part in item for leaf in leaves(part)]
    return [item]


def ids_of(batches: list) -> list[list[int]]:
    return [batch[1].tolist() for batch in batches]


@pytest.fixture(scope="module")
def packed_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "digits"
    pack("digits", None, out, shard_mb=SMALL_SHARDS_MB, progress=False)
    return out


def test_record_round_trip_keeps_dtypes_shapes_and_nesting(tmp_path: Path) -> None:
    items = [
        ((torch.randn(3, 5), torch.tensor(7)), 4),
        (torch.arange(6, dtype=torch.int16).reshape(2, 3), torch.zeros(0), 0.1),
        (torch.randn(4).to(torch.bfloat16), torch.tensor([True, False])),
    ]
    writer = RecordShardWriter(tmp_path / "a.rec")
    for item in items:
        writer.write(encode_record(item))
    info = writer.close()
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


def test_packed_digits_equal_the_raw_splits_and_refuse_overwrite(packed_digits: Path) -> None:
    manifest = load_manifest(packed_digits)
    raw = digits.build()
    assert manifest.count("train") == len(raw.train_dataset) == 1438
    assert manifest.count("val") == len(raw.val_dataset)
    assert len(manifest.splits["train"]) > 1 and manifest.meta == {"num_classes": 10}
    data = open_packed(packed_digits, "digits")
    assert data is not None and data.val is not None
    for index in (0, 700, 1437):
        image, label = data.train[index]
        assert torch.equal(image, raw.train_dataset[index][0])
        assert label == raw.train_dataset[index][1]
    assert torch.equal(data.val[358][0], raw.val_dataset[358][0])
    with pytest.raises(UserError, match="already holds a finished packed set; add --force"):
        pack("digits", None, packed_digits, shard_mb=SMALL_SHARDS_MB, progress=False)
    with pytest.raises(UserError, match="packed for workload 'digits'.*--workload digits"):
        open_packed(packed_digits, "mnist-idx")


def test_interrupted_pack_continues_and_keeps_verified_shards(
    tmp_path: Path, packed_digits: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "digits"
    real_encode, written = pack_sources.encode_record, []

    def interrupt_after_400(item: object) -> bytes:
        if len(written) == 400:
            raise KeyboardInterrupt
        written.append(1)
        return real_encode(item)

    monkeypatch.setattr(pack_sources, "encode_record", interrupt_after_400)
    with pytest.raises(KeyboardInterrupt):
        pack("digits", None, out, shard_mb=SMALL_SHARDS_MB, progress=False)
    monkeypatch.undo()
    assert not (out / "manifest.json").exists()
    with pytest.raises(UserError, match="did not finish"):
        open_packed(out, "digits")
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("train-0000[01].rec")}
    assert len(kept) == 2  # 2 full shards of 178 before the interruption at 400
    (out / "train-00001.rec").write_bytes(b"damaged")  # redone: fails its checksum

    pack("digits", None, out, shard_mb=SMALL_SHARDS_MB, progress=False)
    assert (out / "train-00000.rec").stat().st_mtime_ns == kept["train-00000.rec"]
    assert (out / "train-00001.rec").stat().st_mtime_ns != kept["train-00001.rec"]
    assert load_manifest(out).splits == load_manifest(packed_digits).splits
    assert not (out / ".pack-state.json").exists()

    pack("digits", None, out, shard_mb=SMALL_SHARDS_MB, progress=False, force=True)
    assert load_manifest(out).splits == load_manifest(packed_digits).splits


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
    writer = RecordShardWriter(tmp_path / "train-00000.rec")
    for item in items:
        writer.write(encode_record(item))
    write_manifest(tmp_path, Manifest(workload="w", kind="records", layout=layout_of(items[0]),
                                      splits={"train": [writer.close()]}))
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


def training_losses(run_dir: Path) -> list[float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [record["loss"] for record in records if "event" not in record]


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
    final = load_file(ckpt.list_checkpoints(run_dir / "checkpoints")[0].path / ckpt.MODEL_FILE)
    losses = training_losses(run_dir)

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
    again = load_file(ckpt.list_checkpoints(run_dir / "checkpoints")[0].path / ckpt.MODEL_FILE)
    assert all(torch.equal(final[name], again[name]) for name in final)
    assert training_losses(run_dir) == losses


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


PACK_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, wave
    from pathlib import Path

    import numpy as np

    import gpuflow.workloads.mnist_idx  # imported before the baseline, as packing imports them
    import gpuflow.workloads.speech
    import gpuflow.workloads.textlm
    from gpuflow.data.idx import write_idx
    from gpuflow.workloads.packing import pack

    def peak_rss():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    def growth(run):
        # Linux: writing 5 to clear_refs resets the peak to the current RSS.
        Path("/proc/self/clear_refs").write_text("5")
        baseline = peak_rss()
        result = run()
        return result, peak_rss() - baseline

    root, text_mb, images, clips = (Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                    int(sys.argv[4]))
    rng = np.random.default_rng(0)
    (root / "text").mkdir()
    with open(root / "text" / "corpus.txt", "wb") as handle:  # one document, as a user has
        for _ in range(text_mb):
            handle.write(rng.integers(97, 123, 2**20, dtype=np.uint8).tobytes())
    (root / "idx").mkdir()
    for prefix, count in (("train", images), ("t10k", images // 8)):
        write_idx(root / "idx" / f"{prefix}-images-idx3-ubyte",
                  rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
        write_idx(root / "idx" / f"{prefix}-labels-idx1-ubyte",
                  rng.integers(0, 10, count, dtype=np.uint8))
    (root / "wav").mkdir()
    second = (rng.standard_normal(8000) * 3000).astype("<i2").tobytes()  # 1 s at 8 kHz
    for number in range(clips):  # two speakers: the second is held out for validation
        name = f"{number % 10}_{'ab'[number % 2]}_{number // 10}.wav"
        with wave.open(str(root / "wav" / name), "wb") as writer:
            writer.setnchannels(1)
            writer.setsampwidth(2)
            writer.setframerate(8000)
            writer.writeframes(second)
    del rng
    text, text_growth = growth(lambda: pack("textlm", root / "text", root / "text-packed",
                                            shard_mb=8, progress=False))
    records, idx_growth = growth(lambda: pack("mnist-idx", root / "idx", root / "idx-packed",
                                              shard_mb=8, progress=False))
    audio, audio_growth = growth(lambda: pack("speech", root / "wav", root / "wav-packed",
                                              shard_mb=8, progress=False))
    print(json.dumps({"text_growth": text_growth, "idx_growth": idx_growth,
                      "audio_growth": audio_growth,
                      "clips": audio.count("train") + audio.count("val"),
                      "tokens": text.count("train") + text.count("val"),
                      "records": records.count("train"), "shards": len(records.splits["train"])}))
""")


def test_packing_memory_stays_bounded_far_below_the_corpus(tmp_path: Path) -> None:
    """A 160 MiB one-file text corpus, 48,000 IDX images (150 MiB of float32 records) and
    3,000 one-second WAV clips (92 MiB as float32) are packed in 8 MiB shards; the
    process's peak RSS may grow by at most 48 MiB for each, where holding the data (as
    packing once did; text twice over) would take 92-320 MiB."""
    text_mb, images, clips, cap = 160, 48_000, 3_000, 48 * 2**20
    script = tmp_path / "pack_memory.py"
    script.write_text(PACK_MEMORY_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tmp_path), str(text_mb),
                             str(images), str(clips)], capture_output=True, text=True, timeout=300,
                            env=cli_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["tokens"] == text_mb * 2**20
    assert figures["records"] == images and figures["shards"] >= 18
    assert figures["clips"] == clips
    assert max(figures["text_growth"], figures["idx_growth"], figures["audio_growth"]) < cap, \
        figures


def test_text_pack_streams_the_split_resumes_and_reports_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Packed text is byte for byte the split the raw reader makes; a pack interrupted
    after two shards keeps them and finishes as an uninterrupted pack does; a pack that
    is not on a terminal reports each shard: bytes read, shards written, rate and ETA."""
    from gpuflow.data.text import load_split

    src = tmp_path / "docs"
    src.mkdir()
    rng = np.random.default_rng(1)
    for number in range(12):
        (src / f"doc{number:02d}.txt").write_bytes(
            rng.integers(32, 127, int(rng.integers(2_000, 40_000)), dtype=np.uint8).tobytes())
    (src / "blank.md").write_bytes(b" \n\t\n")  # whitespace only: left out, as raw reading does
    whole = tmp_path / "whole"
    assert main(["data", "pack", str(src), "--out", str(whole), "--workload", "textlm",
                 "--shard-size-mb", "0.03"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pack ")]
    manifest = load_manifest(whole)
    assert len(lines) == sum(len(shards) for shards in manifest.splits.values())
    assert re.fullmatch(r"pack train: [\d.,]+ MiB read, 1 shards written, [\d.,]+ MiB/s, "
                        r"\d+% of [\d.,]+ MiB, ETA \d+ s", lines[0]), lines[0]
    split = load_split(src)
    for name in ("train", "val"):
        packed = b"".join(np.load(whole / s.file).tobytes() for s in manifest.splits[name])
        assert packed == getattr(split, name)

    class InterruptThird(pack_sources.TokenShardWriter):
        closed = 0

        def close(self):  # type: ignore[no-untyped-def]
            if InterruptThird.closed == 2:
                raise KeyboardInterrupt
            InterruptThird.closed += 1
            return super().close()

    out = tmp_path / "resumed"
    monkeypatch.setattr(pack_sources, "TokenShardWriter", InterruptThird)
    with pytest.raises(KeyboardInterrupt):
        pack("textlm", src, out, shard_mb=0.03, progress=False)
    monkeypatch.undo()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("train-*.npy")}
    assert sorted(kept) == ["train-00000.npy", "train-00001.npy"]
    pack("textlm", src, out, shard_mb=0.03, progress=False)
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    assert load_manifest(out).splits == manifest.splits
