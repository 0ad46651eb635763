"""`gpuflow data pack` of conversations streams: worker processes render the lines, the
windows are written as they complete (the packing process never holds the set's windows),
an error on a line in a worker names its file and line and exits 2 leaving no process
behind, and the rerun after the fix keeps the finished shards and writes exactly the
windows training packs in memory."""

from __future__ import annotations

import json
import multiprocessing
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_finetune_chats import CHATS, conversation, write_chats

from gpuflow.cli import main
from gpuflow.data.manifest import PACK_STATE
from gpuflow.data.streaming import open_packed
from gpuflow.model_dir import load_hf_tokenizer
from gpuflow.workloads import chats_pack
from gpuflow.workloads.chat_windows import Window
from gpuflow.workloads.chats import chat_datasets

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEQ_LEN = 64
SHARD_BYTES = 2400  # about three windows of 64 positions
BAD_LINE = 97


class Alive:
    """Counts the windows ``pack_conversations`` makes and how many are alive at most: a
    window is freed when nothing holds its targets any more."""

    def __init__(self) -> None:
        self.made = self.alive = self.peak = 0

    def track(self, windows: Iterator[Window]) -> Iterator[Window]:
        for window in windows:
            self.made += 1
            self.alive += 1
            self.peak = max(self.peak, self.alive)
            weakref.finalize(window[1], self._freed)
            yield window

    def _freed(self) -> None:
        self.alive -= 1


def test_chats_stream_through_workers_and_resume_after_a_bad_line(
        hub_models: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    directory = hub_models["llama"]
    chats = [conversation(*CHATS[i % len(CHATS)]) for i in range(160)]
    data = write_chats(tmp_path / "chats", [*chats[:BAD_LINE - 1], "{oops",
                                            *chats[BAD_LINE:]])
    packed = tmp_path / "packed"
    pack = ["data", "pack", str(data), "--workload", f"hf:{directory}", "--out", str(packed),
            "--seq-len", str(SEQ_LEN), "--shard-size-mb", str(SHARD_BYTES / 2**20),
            "--workers", "2", "--no-progress"]
    assert main(pack) == 2
    assert f"chats.jsonl:{BAD_LINE}: not a JSON object" in capsys.readouterr().err
    assert not multiprocessing.active_children()
    kept = json.loads((packed / PACK_STATE).read_text())["splits"]["train"]
    assert len(kept) >= 5  # the shards before the bad line's chunk were written
    first = packed / kept[0]["file"]
    written = first.stat().st_mtime_ns

    write_chats(data, chats)  # fixed: the rerun continues after the finished shards
    alive = Alive()
    windows = chats_pack.pack_conversations
    monkeypatch.setattr(chats_pack, "pack_conversations",
                        lambda *args: alive.track(windows(*args)))
    manifest = chats_pack.pack_chats(directory, data, packed, SEQ_LEN, False,
                                     SHARD_BYTES / 2**20, False, "off", workers=2)
    assert not multiprocessing.active_children()
    assert first.stat().st_mtime_ns == written
    assert len(manifest.splits["train"]) > 3 * len(kept) / 2

    tokenizer = load_hf_tokenizer(directory)
    train, val = chat_datasets([data / "chats.jsonl"], tokenizer, SEQ_LEN, False)
    assert val is not None
    from_pack = open_packed(packed, chats_pack.CHAT_SET)
    assert from_pack is not None and from_pack.val is not None
    for in_memory, stored in ((train, from_pack.train), (val, from_pack.val)):
        assert len(stored) == len(in_memory)
        for index in range(len(in_memory)):
            (ids, positions), targets = in_memory[index]
            (stored_ids, stored_positions), stored_targets = stored[index]
            assert torch.equal(ids, stored_ids) and torch.equal(positions, stored_positions)
            assert torch.equal(targets, stored_targets)
    # Every window of both splits was made again (the finished ones to be skipped), yet
    # at most the example's and the one being written were alive at once.
    assert alive.made == len(train) + len(val) > 40
    assert alive.peak <= chats_pack.EXAMPLE_WINDOWS + 2, alive.peak
