"""Conversations for fine-tuning: JSONL lines of ``messages`` rendered through a model
directory's chat template, with the loss on the assistant's tokens only.

Which tokens are the assistant's comes from the template's ``{% generation %}`` markers
where it has them (``return_assistant_tokens_mask``), otherwise from rendering the
conversation turn by turn: the assistant's turn ``i`` is the text that rendering
``messages[:i + 1]`` adds to rendering ``messages[:i]`` with the assistant's turn opened
(its content and whatever closes the turn, e.g. ``<|eot_id|>``, which the model must learn
to write), and the tokens whose text starts inside it are labelled. A template whose
renderings do not extend one another has neither, and is refused with the reason.

Conversations are then packed several to a window with attention kept inside each
(``gpuflow.workloads.chat_windows``), in memory here, or into a packed set by
``gpuflow data pack`` (``gpuflow.workloads.chats_pack``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuflow.data.tokenize_worker import VAL_EVERY
from gpuflow.errors import UserError
from gpuflow.workloads.chat_windows import ChatWindows, Conversation, pack_conversations

ROLES = ("system", "user", "assistant", "tool")
GENERATION_MARK = "{% generation %}"


def chat_files(data_dir: str | Path) -> list[Path]:
    """The .jsonl files of ``data_dir`` if their first record holds ``messages``, else
    none (the folder then holds text)."""
    root = Path(data_dir)
    files = sorted(root.rglob("*.jsonl")) if root.is_dir() else []
    for path in files[:1]:
        with open(path, encoding="utf-8", errors="replace") as handle:
            first = next((line for line in handle if line.strip()), "")
        try:
            return files if "messages" in json.loads(first) else []
        except (ValueError, TypeError):
            return []
    return []


def chat_lines(path: Path, split: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of each non-blank line of ``split``: "val" holds the lines
    numbered a multiple of 10, "train" the others."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip() and (number % VAL_EVERY == 0) == (split == "val"):
                yield number, line


def chat_conversation(tokenizer: Any, line: str, where: str, seq_len: int,
                      truncate: bool) -> Conversation:
    """The conversation of JSONL ``line`` as ids and assistant mask; one longer than
    ``seq_len`` + 1 tokens is cut (``truncate``, by the packing) or refused, as is a bad
    line, by a UserError naming ``where``."""
    ids, mask = assistant_tokens(tokenizer, _messages(line, where), where)
    if len(ids) > seq_len + 1 and not truncate:
        raise UserError(f"{where}: the conversation is {len(ids)} tokens, longer than "
                        f"--seq-len {seq_len} + 1. Raise --seq-len, or add --truncate-chats "
                        "to cut long ones.")
    return ids, mask


def _messages(line: str, where: str) -> list[dict[str, str]]:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise UserError(f"{where}: not a JSON object ({error}).") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: no \"messages\" list. Each line of a chat file is "
                        '{"messages": [{"role": "user", "content": "..."}, ...]}.')
    for turn, message in enumerate(messages):
        found = message if isinstance(message, dict) else {}
        role, content = found.get("role"), found.get("content")
        if role not in ROLES or not isinstance(content, str):
            raise UserError(f"{where}: message {turn} has role {role!r} and a "
                            f"{type(content).__name__} content; roles are "
                            f"{', '.join(ROLES)} and content is a string.")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant message, so nothing to learn from it.")
    return messages


def assistant_tokens(tokenizer: Any, messages: list[dict[str, str]],
                     where: str) -> Conversation:
    """The rendered conversation's ids and, per id, whether it is the assistant's."""
    template = tokenizer.chat_template
    if not template:
        raise UserError(f"The tokenizer has no chat template, which {where} needs: add "
                        "chat_template.jinja to the model directory.")
    try:
        if GENERATION_MARK in template.replace("{%- generation %}", GENERATION_MARK):
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        return _by_prefixes(tokenizer, messages, where)
    except UserError:
        raise
    except Exception as error:  # the template's own raise_exception, or jinja's errors
        raise UserError(f"{where}: the chat template refuses this conversation "
                        f"({error}).") from None


def _by_prefixes(tokenizer: Any, messages: list[dict[str, str]],
                 where: str) -> Conversation:
    def render(upto: int, opened: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False,
                                             add_generation_prompt=opened)

    whole = render(len(messages), False)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, after = render(turn, True) if turn else "", render(turn + 1, False)
        if not after.startswith(before) or not whole.startswith(after):
            raise UserError(
                f"{where}: the chat template renders this conversation's turns differently "
                f"from the whole (turn {turn} does not extend the turns before it), and it has "
                "no {% generation %} markers, so the assistant's tokens cannot be found. Add "
                "{% generation %}...{% endgeneration %} around the assistant's content in the "
                "template.")
        spans.append((len(before), len(after)))
    encoded = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(start <= begin < end for start, end in spans)
            for begin, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def tokenized_chats(files: list[Path], tokenizer: Any, seq_len: int,
                    truncate: bool) -> dict[str, list[Conversation]]:
    """The conversations of ``files`` as ids and assistant masks, by split ("train", and
    "val": lines numbered a multiple of 10); one longer than ``seq_len`` + 1 tokens is cut
    (``truncate``) or refused."""
    splits = {split: [chat_conversation(tokenizer, line, f"{path}:{number}", seq_len,
                                        truncate)
                      for path in files for number, line in chat_lines(path, split)]
              for split in ("train", "val")}
    if not splits["train"]:
        raise UserError(f"{files[0].parent} holds no training conversations.")
    return splits


def pad_id(tokenizer: Any) -> int:
    """The id padding a window's end: the tokenizer's pad token, else its EOS, else 0
    (never learned nor attended to by the conversations)."""
    return next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None),
                0)


def chat_datasets(files: list[Path], tokenizer: Any, seq_len: int,
                  truncate: bool) -> tuple[ChatWindows, ChatWindows | None]:
    """Training and held-out windows of conversations packed in memory."""
    splits = tokenized_chats(files, tokenizer, seq_len, truncate)
    train, val = (ChatWindows(list(pack_conversations(splits[name], seq_len,
                                                      pad_id(tokenizer))))
                  for name in ("train", "val"))
    return train, val if len(val) else None
