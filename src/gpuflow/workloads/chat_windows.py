"""Conversations packed several to a training window, attention kept inside each.

Conversations are laid end to end in their order in the files, a window holding as many
whole ones as fit in ``seq_len`` positions (a conversation of ``n`` tokens takes ``n - 1``:
its inputs are all but its last token, its targets all but its first); the rest of a window
is padding. Each conversation's ``position_ids`` restart at 0, and so do the padding's:
``transformers`` reads restarting positions (with no attention mask and no cache) as packed
sequences and masks attention to each one (``masking_utils.find_packed_sequence_indices``,
for SDPA, eager and flex attention; flash attention takes them as its sequence lengths), and
rotary positions count from each conversation's start, so a packed conversation's logits are
those of the conversation alone. Targets are -100 (``IGNORE_INDEX``) but on the assistant's
tokens, so neither the padding nor the first token of a conversation (which the previous one
cannot predict) is learned.

An item is ``((ids, positions), targets)`` as int32 (packed sets store them so), and
:func:`collate_windows` makes a batch of them the model's keyword inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from gpuflow.workload import IGNORE_INDEX

Conversation = tuple[list[int], list[bool]]  # ids, and per id whether it is the assistant's
Window = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]


def pack_conversations(conversations: Iterable[Conversation], seq_len: int,
                       pad_id: int) -> Iterator[Window]:
    """Windows of ``seq_len`` positions holding whole conversations in order; one longer
    than ``seq_len`` + 1 tokens is cut to its first ``seq_len`` + 1 (refuse it before)."""
    ids: list[int] = []
    targets: list[int] = []
    positions: list[int] = []
    for tokens, learned in conversations:
        length = min(len(tokens), seq_len + 1) - 1
        if ids and len(ids) + length > seq_len:
            yield _window(ids, targets, positions, seq_len, pad_id)
            ids, targets, positions = [], [], []
        ids += tokens[:length]
        targets += [token if learn else IGNORE_INDEX
                    for token, learn in zip(tokens[1:length + 1], learned[1:length + 1],
                                            strict=True)]
        positions += range(length)
    if ids:
        yield _window(ids, targets, positions, seq_len, pad_id)


def _window(ids: list[int], targets: list[int], positions: list[int], seq_len: int,
            pad_id: int) -> Window:
    pad = seq_len - len(ids)
    return ((torch.tensor(ids + [pad_id] * pad, dtype=torch.int32),
             torch.tensor(positions + list(range(pad)), dtype=torch.int32)),
            torch.tensor(targets + [IGNORE_INDEX] * pad, dtype=torch.int32))


def collate_windows(items: Sequence[Sequence[Any]]
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A batch of windows as ``({"input_ids", "position_ids"}, targets)``, all int64."""
    ids, positions, targets = (torch.stack(column).long() for column in zip(
        *((*inputs, target) for inputs, target in items), strict=True))
    return {"input_ids": ids, "position_ids": positions}, targets


class ChatWindows(Dataset):
    """Packed windows held in memory, one item each."""

    def __init__(self, windows: list[Window]) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> Window:
        return self.windows[index]
