"""gpuflow data pack: packed sets equal the raw splits, resume after an interruption, and
pack in bounded memory."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, cli_env
from packed_sets import SMALL_SHARDS_MB

from gpuflow.cli import main
from gpuflow.data import pack_sources
from gpuflow.data.manifest import load_manifest
from gpuflow.data.streaming import open_packed
from gpuflow.errors import UserError
from gpuflow.workloads import digits
from gpuflow.workloads.packing import pack


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
