"""`gpuflow data pack`: convert a data set into shards that training streams."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def register(commands: Any) -> None:
    data = commands.add_parser("data", help="prepare data sets (pack into shards)")
    actions = data.add_subparsers(dest="data_command", required=True)
    pack = actions.add_parser(
        "pack", help="convert a workload's data set into checksummed shards",
        description="Convert a workload's data set into fixed-size shards with an index and "
                    "a manifest; `gpuflow train --data-dir OUT` then streams them. An "
                    "interrupted pack continues where it stopped when run again.")
    pack.add_argument("src", nargs="?",
                      help="the workload's raw data (its --data-dir); omit for its default "
                           "(digits: the bundled scans, textlm: the Python documentation)")
    pack.add_argument("--out", required=True, help="folder to write the packed set to")
    pack.add_argument("--workload", required=True,
                      help="digits, mnist-idx, textlm, speech, images, hf:DIR (text, or JSONL "
                           "conversations, under the tokenizer of model directory DIR), or "
                           "pkg.module:factory")
    pack.add_argument("--shard-size-mb", type=float,
                      help="target size of each shard in MiB (default 64)")
    pack.add_argument("--max-side", type=int, metavar="PX",
                      help="images: re-encode photos larger than PX on their longer side")
    pack.add_argument("--tokenizer", metavar="DIR",
                      help="textlm: tokenize the text (.txt/.md/.rst files, .jsonl lines) with "
                           "the tokenizer of model directory DIR, into uint16/uint32 tokens "
                           "with its EOS id after each document")
    pack.add_argument("--text-field", metavar="NAME",
                      help="with --tokenizer: the field of each .jsonl line holding its text "
                           "(default: text)")
    pack.add_argument("--workers", type=int, metavar="N",
                      help="with --tokenizer, or hf:DIR with conversations: tokenizer "
                           "processes (default: one per core; 0: in this process)")
    pack.add_argument("--seq-len", type=int, metavar="N",
                      help="hf:DIR with a JSONL of conversations: the window length they are "
                           "packed to, several to a window (default: the model's context, at "
                           "most 1024, as training takes it)")
    pack.add_argument("--truncate-chats", action="store_true",
                      help="hf:DIR conversations: cut one longer than --seq-len + 1 tokens "
                           "instead of refusing it")
    pack.add_argument("--force", action="store_true",
                      help="pack again over a finished set in --out")
    pack.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress report (by default a live bar on a terminal, else a "
                           "line per shard on stderr: bytes read, shards, MiB/s, ETA)")
    data.set_defaults(handler=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gpuflow.data.pack import DEFAULT_SHARD_MB
    from gpuflow.errors import UserError
    from gpuflow.workloads.packing import pack

    shard_mb = DEFAULT_SHARD_MB if args.shard_size_mb is None else args.shard_size_mb
    if shard_mb <= 0:
        raise UserError("--shard-size-mb must be positive.")
    progress = ("off" if not args.progress else "bar" if sys.stderr.isatty() else "lines")
    manifest = pack(args.workload, args.src, args.out, shard_mb=shard_mb,
                    force=args.force, progress=progress, max_side=args.max_side,
                    tokenizer=args.tokenizer, text_field=args.text_field, workers=args.workers,
                    seq_len=args.seq_len, truncate_chats=args.truncate_chats)
    counts = ", ".join(f"{name} {manifest.count(name):,} "
                       f"{'tokens' if manifest.kind == 'tokens' else 'samples'} in "
                       f"{len(shards)} shard(s)" for name, shards in manifest.splits.items())
    print(f"packed {manifest.workload} into {args.out}: {counts}")
    return 0
