"""LoRA and QLoRA against the full fine-tune: peak memory and tokens/s of `gpuflow train --workload
hf:DIR` on the same Llama-architecture directory, batch, sequence length and precision.

The directory is ``finetune.py``'s (a ``LlamaConfig`` of ``--dim``/``--layers``, random
weights, the test suite's 4,096-id tokenizer), saved in bf16 as Hub checkpoints are.
Contenders, each a `gpuflow train` process of its own (the peak is the process's resident
set: on a CPU, gpuflow's summary reports `process_peak_rss`), taking turns in rounds. Linux
hands a process started by ``subprocess`` its parent's peak resident set as its own starting
peak, so the directory is made in a process of its own and this one stays below every
contender (``launcher_peak_rss_bytes`` in the results says how far):
- ``full``: every weight trains, fp32 master weights, AdamW moments for all of them.
- ``lora``: ``--lora-rank 16`` on all linear layers; the base frozen and held in bf16.
- ``qlora``: the same with ``--quantize-base nf4``: the frozen linear layers held as NF4.
Both run bf16 autocast on random ids (``--data synthetic``), AdamW, no checkpoints. Tokens/s
is the median over the steps after the first two of each round.

Run: ``python benchmarks/lora_memory.py --dim 2048 --layers 22``, the ~1B configuration issue
52 names (1.03B parameters: ~35 minutes on 2 cores, the full fine-tune peaking at ~18.5 GiB);
without the flags, 147M parameters in a few minutes. On a GPU
(``gpu_stages.py``'s ``lora-memory``) the peak is torch's, of the device, and ``--dry-run``
walks that stage on the CPU at a tiny size.
Writes ``benchmarks/results/lora_memory-<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))  # hub_models: the tokenizer
import _common  # noqa: E402
from finetune import make_directory, medians  # noqa: E402

RANK = 16
CONTENDERS = {"full": [], "lora": ["--lora-rank", str(RANK)],
              "qlora": ["--lora-rank", str(RANK), "--quantize-base", "nf4"]}


def bf16_directory(root: Path, dim: int, layers: int, seq: int) -> Path:
    """``finetune.py``'s directory, its weights saved again in bf16."""
    from transformers import AutoModelForCausalLM

    directory = make_directory(root, dim, layers, seq)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def run(directory: Path, flags: list[str], run_dir: Path, args: argparse.Namespace
        ) -> dict[str, Any]:
    """One `gpuflow train` process: its peak memory, tokens/s and trained parameters."""
    command = [sys.executable, "-m", "gpuflow.cli", "train", "--workload", f"hf:{directory}",
               "--device", args.device, "--data", "synthetic", "--seq-len", str(args.seq),
               "--batch-size",
               str(args.batch), "--max-steps", str(args.steps), "--precision", "bf16",
               "--lr", "1e-4", "--schedule", "constant", "--warmup-steps", "0",
               "--eval-every", "0", "--eval-batches", "1", "--log-every", "1",
               "--no-checkpoints", "--no-progress", "--run-dir", str(run_dir), *flags]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    found = medians(run_dir, args.batch, args.seq)
    return {"peak_mem_bytes": summary["peak_mem_bytes"],
            "peak_mem_kind": summary["peak_mem_kind"], "device_name": summary["device_name"],
            "trainable_params": summary["trainable_params"],
            "tokens_per_s": found["tokens_per_s"], "step_s": found["step_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="auto", help="as gpuflow train's --device")
    parser.add_argument("--dry-run", action="store_true",
                        help="the run on the CPU at a tiny size, one round (the file says so)")
    parser.add_argument("--out", type=Path, default=_common.default_result_path("lora_memory"))
    args = parser.parse_args()
    if args.dry_run:
        args.device, args.dim, args.layers, args.seq, args.steps, args.rounds = (
            "cpu", 128, 2, 64, 3, 1)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=spawn) as maker:
            directory = maker.submit(bf16_directory, root, args.dim, args.layers,
                                     args.seq).result()
        load = _common.ForeignLoad()
        for number in range(args.rounds):
            found = {name: run(directory, flags, root / f"{name}-{number}", args)
                     for name, flags in CONTENDERS.items()}
            print(json.dumps(found), flush=True)
            rounds.append(found)
    ratios = {f"{name}_over_full_{key}_median": statistics.median(
        r[name][field] / r["full"][field] for r in rounds)
        for name in ("lora", "qlora")
        for key, field in (("peak_memory", "peak_mem_bytes"), ("tokens_per_s", "tokens_per_s"))}
    payload = {
        "benchmark": "lora_memory", **_common.provenance(
            transformers=_common.package_version("transformers"),
            peft=_common.package_version("peft")),
        "dry_run": args.dry_run, "device_name": rounds[0]["full"]["device_name"],
        "machine": _common.machine_info(), "foreign_cpu_share": load.share(),
        "launcher_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "model": {"dim": args.dim, "layers": args.layers, "seq": args.seq, "batch": args.batch,
                  "steps": args.steps, "precision": "bf16 autocast", "saved_dtype": "bf16",
                  "lora_rank": RANK, "lora_targets": "all-linear"},
        "rounds": rounds,
        **ratios,
        "target": "LoRA at most 0.45x the full fine-tune's peak memory, at least 1.2x its "
                  "tokens/s; QLoRA at most 0.30x its peak memory (issue 52)",
    }
    _common.write_json(args.out, payload)
    for name in ("lora", "qlora"):
        print(f"{name} / full: peak memory {ratios[f'{name}_over_full_peak_memory_median']:.3f}"
              f", tokens/s {ratios[f'{name}_over_full_tokens_per_s_median']:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
