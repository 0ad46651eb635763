"""Fine-tuning a Llama-architecture model directory: `--workload hf:DIR` against a plain
PyTorch loop on the same model, batches and precision, and beside `textlm` of a similar size.

The directory is built here: a ``LlamaConfig`` of ``--dim``/``--layers`` (heads of 64,
grouped-query attention over half as many key/value heads, MLP 8/3 x dim), random weights,
and the test suite's Llama-3-style tokenizer (4,096 ids), saved as the Hub lays it out. The
data is the Python help topics packed under that tokenizer (`gpuflow data pack
--tokenizer`).

Contenders, taking turns in rounds inside this process (bf16 autocast, AdamW betas
0.9/0.95, no clipping, constant learning rate, one process):
- ``gpuflow``: ``gpuflow.train`` on ``hf:DIR``, metrics.jsonl written every step.
- ``plain``: ``AutoModelForCausalLM.from_pretrained(DIR)``, random windows of the same
  packed ids, forward, fp32 cross-entropy, backward, fused AdamW step, ``zero_grad``.
- ``textlm``: gpuflow's own GPT of the same depth and width over the same tokenizer, for
  its MFU beside the Hugging Face model's.
Step times are medians after the first two steps of each round. MFU is the FLOPs gpuflow
counts per step (FlopCounterMode on one step of the model) over the step time, against
the peak gpuflow's summary names with its source; the plain loop is held to the same count.

Run: ``python benchmarks/finetune.py`` (a few minutes on 2 cores).
Writes ``benchmarks/results/finetune-<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))  # hub_models: the tokenizer
import _common  # noqa: E402

LR = 1e-4
WARM = 2  # steps of each round left out of the medians


def make_directory(root: Path, dim: int, layers: int, seq: int) -> Path:
    from hub_models import build_tokenizer, save_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = build_tokenizer("llama3")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=dim, num_hidden_layers=layers,
                         num_attention_heads=dim // 64, num_key_value_heads=max(1, dim // 128),
                         intermediate_size=8 * dim // 3, max_position_embeddings=max(seq, 1024),
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    out = root / "llama"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    save_tokenizer("llama3", out)
    return out


def medians(run_dir: Path, batch: int, seq: int) -> dict[str, Any]:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r.get("step_time_s") is not None][WARM:]
    step = statistics.median(r["step_time_s"] for r in steps)
    return {"step_s": step, "tokens_per_s": batch * seq / step,
            "mfu": statistics.median(r["mfu"] for r in steps),
            "flops_per_step": steps[0]["flops_per_step"]}


def run_gpuflow(spec: str, options: dict[str, Any], run_dir: Path, steps: int, batch: int,
                seq: int) -> dict[str, Any]:
    from gpuflow import TrainConfig, resolve_workload, train

    torch.manual_seed(0)
    workload = resolve_workload(spec, options)
    train(workload, TrainConfig(workload=spec, max_steps=steps, batch_size=batch, lr=LR,
                                precision="bf16", schedule="constant", warmup_steps=0,
                                clip_grad=None, eval_every=0, log_every=1, progress=False,
                                save_checkpoints=False, run_dir=str(run_dir)))
    found = medians(run_dir, batch, seq)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {**found, "peak_flops": summary["peak_flops"],
            "peak_flops_source": summary["peak_flops_source"]}


def run_plain(directory: Path, ids: np.ndarray, steps: int, batch: int,
              seq: int) -> list[float]:
    """The hand-written loop's step times."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa",
                                                 dtype=torch.float32).train()
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), fused=True)
    generator = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        starts = generator.integers(0, len(ids) - seq - 1, batch)
        window = torch.from_numpy(np.stack([ids[s:s + seq + 1] for s in starts]).astype(np.int64))
        x, y = window[:, :-1], window[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=_common.default_result_path("finetune"))
    args = parser.parse_args()
    from gpuflow.data.manifest import load_manifest
    from gpuflow.workloads.packing import pack

    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        directory = make_directory(root, args.dim, args.layers, args.seq)
        packed = root / "packed"
        pack("textlm", None, packed, progress=False, tokenizer=directory, workers=0)
        ids = np.concatenate([np.load(packed / s.file)
                              for s in load_manifest(packed).splits["train"]])
        load = _common.ForeignLoad()
        size = f"layers={args.layers},dim={args.dim},heads={args.dim // 64},seq={args.seq}"
        for number in range(args.rounds):
            found: dict[str, Any] = {}
            found["gpuflow"] = run_gpuflow(
                f"hf:{directory}", {"data_dir": str(packed), "seq_len": args.seq},
                root / f"hf-{number}", args.steps, args.batch, args.seq)
            step = statistics.median(run_plain(directory, ids, args.steps, args.batch,
                                               args.seq)[WARM:])
            gpu = found["gpuflow"]
            found["plain"] = {"step_s": step, "tokens_per_s": args.batch * args.seq / step,
                              "mfu": gpu["flops_per_step"] / step / gpu["peak_flops"]}
            found["textlm"] = run_gpuflow(
                "textlm", {"data_dir": str(packed), "model_size": size,
                           "tokenizer": str(directory)},
                root / f"textlm-{number}", args.steps, args.batch, args.seq)
            print(json.dumps(found), flush=True)
            rounds.append(found)
        ratios = [r["gpuflow"]["tokens_per_s"] / r["plain"]["tokens_per_s"] for r in rounds]
        payload = {
            "benchmark": "finetune", **_common.provenance(
                transformers=_common.package_version("transformers")),
            "machine": _common.machine_info(), "foreign_cpu_share": load.share(),
            "model": {"dim": args.dim, "layers": args.layers, "seq": args.seq,
                      "batch": args.batch, "precision": "bf16 autocast"},
            "rounds": rounds, "gpuflow_over_plain_tokens_per_s_median": statistics.median(ratios),
            "target": "gpuflow within 3% of the plain loop per token",
        }
    _common.write_json(args.out, payload)
    print(f"gpuflow / plain tokens/s: {payload['gpuflow_over_plain_tokens_per_s_median']:.3f}; "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
