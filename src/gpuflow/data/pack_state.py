"""An unfinished pack's progress: the shards finished so far, saved after each one.

A rerun with the same settings keeps, per split, the leading shards whose files still match
their checksums and continues after them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gpuflow.data.manifest import PACK_STATE, ShardInfo, sha256_file
from gpuflow.errors import UserError


@dataclass
class LabelTally:
    """The largest integer target packed so far, for ``meta["num_classes"]``; ``None``
    once a target is not an integer. Kept in the pack state, so a resumed pack knows the
    labels of the shards it keeps without reading them again (rewritten shards hold the
    same items, so counting one twice changes nothing)."""

    top: int | None = -1

    def add(self, item: Any) -> None:
        if self.top is None:
            return
        target = torch.as_tensor(item[1])
        self.top = (None if target.ndim != 0 or target.is_floating_point()
                    else max(self.top, int(target)))

    def meta(self) -> dict[str, Any]:
        return {"num_classes": self.top + 1} if self.top is not None and self.top >= 0 else {}


class PackState:
    """The shards finished so far, saved after each one, and the settings they belong to.

    A source that cannot tell from token counts where its input stands (a tokenizer's
    output has no fixed length) records with each shard a ``cursor``: how far into its
    input the shard ends, which ``cursor`` gives back after the kept shards."""

    def __init__(self, out: Path, settings: dict[str, Any]) -> None:
        self.path = out / PACK_STATE
        self.settings = settings
        self.splits: dict[str, list[ShardInfo]] = {}
        self.labels = LabelTally()
        self.cursors: dict[str, list[int]] = {}

    @classmethod
    def resume(cls, out: Path, settings: dict[str, Any]) -> PackState:
        """Keep, per split, the leading shards whose files still match their checksums."""
        state = cls(out, settings)
        if not state.path.is_file():
            return state
        saved = json.loads(state.path.read_text())
        if saved["settings"] != settings:
            raise UserError(
                f"--out {out} holds an unfinished pack made with other settings "
                f"({saved['settings']}). Rerun with those, or add --force to start over."
            )
        state.labels = LabelTally(saved.get("labels_top", -1))
        saved_cursors = saved.get("cursors", {})
        for split, shards in saved["splits"].items():
            kept = state.splits.setdefault(split, [])
            for shard in map(lambda s: ShardInfo(**s), shards):
                path = out / shard.file
                if (not path.is_file() or path.stat().st_size != shard.bytes
                        or sha256_file(path) != shard.sha256):
                    break
                kept.append(shard)
            if split in saved_cursors:
                state.cursors[split] = saved_cursors[split][:len(kept)]
        return state

    def done(self, split: str) -> tuple[int, int]:
        """Records (or tokens) and shards of ``split`` finished so far."""
        shards = self.splits.get(split, [])
        return sum(shard.count for shard in shards), len(shards)

    def cursor(self, split: str) -> int:
        """Where the input of ``split`` stands after its kept shards (0: at the start)."""
        return (self.cursors.get(split) or [0])[-1]

    def record(self, split: str, shard: ShardInfo, cursor: int | None = None) -> None:
        self.splits.setdefault(split, []).append(shard)
        if cursor is not None:
            self.cursors.setdefault(split, []).append(cursor)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"settings": self.settings, "labels_top": self.labels.top,
                                   "cursors": self.cursors,
                                   "splits": {name: [asdict(s) for s in shards]
                                              for name, shards in self.splits.items()}}))
        os.replace(tmp, self.path)
