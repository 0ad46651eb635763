"""`gpuflow predict`: offline batch prediction over files and folders into a JSONL file."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "predict", help="predict over files and folders offline, into a JSONL file",
        description="Run a model over files and folders (images, WAV clips, text files or "
                    "JSON request bodies) or packed sets and write one JSON line per file or "
                    "sample. Rerun the same "
                    "command after an interruption: inputs already in --out are skipped.")
    add = parser.add_argument
    add("source", metavar="RUN_DIR|MODEL.safetensors", help="a gpuflow run dir or export")
    add("inputs", nargs="+", metavar="INPUT",
        help="files, folders, or packed sets (`gpuflow data pack`: every sample)")
    add("--out", required=True, help="the JSONL file to write (appended to when resuming)")
    add("--workload", help="rebuild the model with this workload instead of the saved one")
    add("--batch-size", type=int, default=64, help="rows per batch (default 64)")
    add("--num-workers", type=int, default=2,
        help="loader worker processes reading and decoding files (default 2)")
    add("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    add("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="default fp32")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--top-k", type=int, default=5, help="most probable labels per prediction (default 5)")
    add("--max-new-tokens", type=int, default=16, help="text models: bytes to generate")
    add("--temperature", type=float, default=0.0, help="text models: 0 is greedy")
    add("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from pydantic import ValidationError

    from gpuflow.errors import UserError
    from gpuflow.serve.engine import Engine, EngineOptions
    from gpuflow.serve.predict import collect_inputs, predict_files
    from gpuflow.serving import PredictRequest

    if args.batch_size < 1 or args.num_workers < 0:
        raise UserError("--batch-size must be at least 1 and --num-workers 0 or more.")
    defaults = {"top_k": args.top_k, "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature}
    try:
        PredictRequest(**defaults)
    except ValidationError as exc:
        raise UserError(f"--top-k, --max-new-tokens or --temperature out of range: "
                        f"{exc.errors()[0]['msg']}.") from None
    engine = Engine.load(args.source, EngineOptions(args.device, args.precision, args.compile,
                                                    max_batch_size=args.batch_size),
                         args.workload)
    paths = collect_inputs(args.inputs, engine.codec.file_suffixes,
                           getattr(engine.codec, "seq_len", None))
    if not paths:
        raise UserError(f"No input files found; this model reads "
                        f"{', '.join(engine.codec.file_suffixes)} files.")
    print(f"gpuflow predict: {len(paths)} file(s), {engine.runner.describe()}")
    stats = predict_files(engine, paths, Path(args.out), num_workers=args.num_workers,
                          defaults=defaults, progress=args.progress)
    rate = stats.files / stats.seconds if stats.seconds > 0 else 0.0
    print(f"predicted {stats.files} file(s) ({stats.rows} rows) in {stats.seconds:.2f} s: "
          f"{rate:.1f} files/s, {stats.rows / max(stats.seconds, 1e-9):.1f} rows/s"
          + (f"; skipped {stats.skipped} already in {args.out}" if stats.skipped else "")
          + (f"; {stats.failed} file(s) could not be read (see their 'error')"
             if stats.failed else ""))
    return 0
