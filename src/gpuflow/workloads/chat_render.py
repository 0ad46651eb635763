"""Conversations rendered and tokenized in worker processes, streamed in file order.

The packing process reads the JSONL a line at a time and hands the lines of one split, a
chunk at a time, to processes that each load the model directory's tokenizer once and
render every line through its chat template (``gpuflow.workloads.chats``); conversations
come back in file order, a bounded number of chunks ahead, so memory holds those chunks
and never the chat set. An error on a line (bad JSON, a conversation too long) is raised in
the worker naming ``file:line``, and raised again here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

from gpuflow.data.worker_pool import ordered_map
from gpuflow.model_dir import load_hf_tokenizer
from gpuflow.workloads.chat_windows import Conversation
from gpuflow.workloads.chats import chat_conversation, chat_lines

CHUNK_LINES = 32  # lines a worker renders per task
IN_FLIGHT = 2  # chunks per worker submitted ahead

Line = tuple[str, int, str]  # file, line number, the line
Renderer = Callable[[list[Path], str], Iterator[Conversation]]  # files, split

_tokenizer: Any = None


def start(directory: str) -> None:
    """A worker's initializer: the tokenizer, loaded once per process."""
    global _tokenizer
    _tokenizer = load_hf_tokenizer(Path(directory))


def render_chunk(lines: list[Line], seq_len: int, truncate: bool) -> list[Conversation]:
    """The conversations of ``lines``, in order (``start`` first)."""
    assert _tokenizer is not None, "start() first"
    return [chat_conversation(_tokenizer, line, f"{path}:{number}", seq_len, truncate)
            for path, number, line in lines]


@contextmanager
def chat_renderer(directory: Path, seq_len: int, truncate: bool,
                  workers: int) -> Iterator[Renderer]:
    """Renders the conversations of a split of files, in order, by ``workers`` processes
    (0: in this one) kept for every split; the processes end on leaving, error or not."""
    render = partial(render_chunk, seq_len=seq_len, truncate=truncate)
    with ordered_map(workers, start, (str(directory),), IN_FLIGHT) as mapped:

        def rendered(files: list[Path], split: str) -> Iterator[Conversation]:
            chunks = _chunks((str(path), number, line) for path in files
                             for number, line in chat_lines(path, split))
            for conversations in mapped(render, chunks):
                yield from conversations

        yield rendered


def _chunks(lines: Iterator[Line]) -> Iterator[list[Line]]:
    while chunk := list(islice(lines, CHUNK_LINES)):
        yield chunk
