"""KV positions one decode step reads: FlexAttention's paged mask against the padded path.

The static-shape decode step (``decode_attention``) reads every block a row's table can
name, the table padded to the model's context; ``flex_decode_attention`` reads the blocks
the row holds. For batches of rows of mixed lengths (16 to 4,000 tokens, uniformly, drawn
once from a fixed seed) over contexts of 8k, 32k and 128k, this counts the positions read
per KV head and layer in one step: by flex's mask (``read_positions``, from the mask's
own block counts), by the padded path (rows x table width), and held (the rows' lengths).
Target (issue 50): flex's reads <= 1.1 x the positions held.

Pool blocks that 16 does not divide cannot be flex's KV blocks (see ``flex``); for 8-token
blocks it states what a mask of 16-position blocks, two pool blocks each, would read: every
distinct pair a row's blocks fall in, on a pool handed out in order and on a fragmented one.

On the CPU it also checks that flex's output equals ``decode_attention``'s (torch's eager
flex, every pool slot scored through the mask's ``mask_mod``) and states the max
difference. Counting needs no GPU: the masks are built where the step would build them.
With ``--cuda`` (a GPU) it also runs one layer's attention both ways, each compiled and
replayed as a CUDA graph (``mode="reduce-overhead"``), 64 rows at a 32k context, 32
query heads over 8 KV heads of 128 dims in bf16: their outputs' max difference and the
time of a replay.

    .venv/bin/python benchmarks/attention_traffic.py        # ~10 s on 2 cores
    .venv/bin/python benchmarks/attention_traffic.py --cuda # on a GPU
"""

from __future__ import annotations

import argparse
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import default_result_path, machine_info, provenance, write_json  # noqa: E402

from gpuflow.serve.generate.attention import decode_attention  # noqa: E402
from gpuflow.serve.generate.blocks import blocks_for  # noqa: E402
from gpuflow.serve.generate.flex import (  # noqa: E402
    flex_applies,
    flex_decode_attention,
    paged_decode_mask,
    read_positions,
)
from gpuflow.serve.generate.paged import KVPool  # noqa: E402

SEED = 50
SHORTEST, LONGEST = 16, 4000
CONTEXTS = (8192, 32768, 131072)
BATCHES = ((64, 16, None), (256, 16, None), (64, 32, None), (64, 16, 1024))  # rows, block, window


def lengths_of(rows: int, seed: int = SEED) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(SHORTEST, LONGEST) for _ in range(rows)]


def tables_for(lengths: list[int], block_size: int, width: int, shuffled: bool,
               seed: int = SEED) -> torch.Tensor:
    """Each row's blocks out of one pool (never the null block): handed out in order, or
    shuffled as a pool fragments; padded with the null block to ``width``."""
    need = [blocks_for(n, block_size) for n in lengths]
    pool = list(range(1, 1 + sum(need)))
    if shuffled:
        random.Random(seed).shuffle(pool)
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    taken = 0
    for row, count in enumerate(need):
        tables[row, :count] = torch.tensor(pool[taken:taken + count])
        taken += count
    return tables


def held_positions(lengths: list[int], window: int | None) -> int:
    return sum(n if window is None else min(n, window) for n in lengths)


def traffic(rows: int, block_size: int, window: int | None, context: int) -> dict[str, Any]:
    """One step's reads for ``rows`` rows at ``context``: flex's mask, the padded path."""
    lengths = lengths_of(rows)
    width = context // block_size
    tables = tables_for(lengths, block_size, width, shuffled=True)
    mask = paged_decode_mask(tables, torch.tensor(lengths) - 1, block_size,
                             int(tables.max()) + 1, window)
    held, flex = held_positions(lengths, window), read_positions(mask)
    padded = rows * width * block_size
    return {"rows": rows, "block_size": block_size, "sliding_window": window,
            "context": context, "positions_held": held, "flex_reads": flex,
            "padded_reads": padded, "flex_over_held": round(flex / held, 4),
            "padded_over_held": round(padded / held, 2),
            "padded_over_flex": round(padded / flex, 2)}


def grouped_reads(block_size: int = 8, group_positions: int = 16, rows: int = 64
                  ) -> dict[str, Any]:
    """What a mask of ``group_positions``-wide blocks would read over ``block_size``-token
    pool blocks: every distinct group a row's blocks fall in, whole."""
    lengths = lengths_of(rows)
    group = group_positions // block_size
    width = max(blocks_for(n, block_size) for n in lengths)
    held = sum(lengths)
    result: dict[str, Any] = {"block_size": block_size, "mask_block": group_positions,
                              "rows": rows, "positions_held": held}
    for name, shuffled in (("in_order", False), ("fragmented", True)):
        tables = tables_for(lengths, block_size, width, shuffled)
        reads = sum(len(set((tables[row, :blocks_for(n, block_size)] // group).tolist()))
                    for row, n in enumerate(lengths)) * group_positions
        result[name] = {"reads": reads, "over_held": round(reads / held, 4)}
    return result


def equality(seed: int = SEED) -> list[dict[str, Any]]:
    """Flex's output against ``decode_attention``'s on the CPU (eager flex): 8 rows of 16
    to 400 tokens over a shuffled pool, 8 query heads over 2 KV heads of 16 dims."""
    results = []
    for window in (None, 64):
        lengths = lengths_of(8, seed)
        lengths = [16 + n % 385 for n in lengths]
        tables = tables_for(lengths, 16, max(blocks_for(n, 16) for n in lengths) + 1, True)
        pool = KVPool(1, int(tables.max()) + 4, 2, 16, 16, "cpu", torch.float32)
        generator = torch.Generator().manual_seed(seed)
        pool.keys.normal_(generator=generator)
        pool.values.normal_(generator=generator)
        q = torch.randn(len(lengths), 8, 16, generator=generator)
        positions = torch.tensor(lengths) - 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex: "unfused implementation"
            got = flex_decode_attention(q, pool, 0, positions, tables, None, window)
        want = decode_attention(q, pool, 0, positions, tables, None, window)
        results.append({"sliding_window": window, "lengths": lengths, "dtype": "fp32",
                        "max_abs_difference": float((got - want).abs().max())})
    return results


def cuda_step(rows: int = 64, context: int = 32768, replays: int = 50) -> dict[str, Any]:
    """One layer's decode attention on CUDA, padded and flex, each compiled and captured."""
    lengths, size = lengths_of(rows), 16
    tables = tables_for(lengths, size, context // size, True).cuda()
    pool = KVPool(1, int(tables.max()) + 1, 8, size, 128, "cuda", torch.bfloat16)
    pool.keys.normal_()
    pool.values.normal_()
    for tensor in (pool.keys, pool.values):  # as the runner does: graphs read it in place
        torch._dynamo.mark_static_address(tensor)
    q = torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.tensor(lengths, device="cuda") - 1
    assert flex_applies(q, pool)
    result: dict[str, Any] = {"rows": rows, "context": context, "heads": "32 over 8 KV",
                              "head_dim": 128, "dtype": "bf16", "device":
                              torch.cuda.get_device_name()}
    outputs = {}
    for name, attend in (("padded", decode_attention), ("flex", flex_decode_attention)):
        step = torch.compile(lambda q, p, t, attend=attend: attend(q, pool, 0, p, t),
                             mode="reduce-overhead", dynamic=False, fullgraph=True)

        def replay(step: Any = step) -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            return step(q, positions, tables)

        for _ in range(3):  # cudagraph trees record on the second call
            out = replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            out = replay()
        end.record()
        torch.cuda.synchronize()
        outputs[name] = out.float().clone()
        result[f"{name}_ms"] = round(start.elapsed_time(end) / replays, 4)
    result["max_abs_difference"] = float((outputs["flex"] - outputs["padded"]).abs().max())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cuda", action="store_true", help="also time one layer on a GPU")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = [traffic(rows, size, window, context)
               for rows, size, window in BATCHES for context in CONTEXTS]
    for b in batches:
        window = f", window {b['sliding_window']}" if b["sliding_window"] else ""
        print(f"{b['rows']:4} rows, {b['block_size']}-token blocks{window}, context "
              f"{b['context']:6}: flex reads {b['flex_over_held']:.3f} x held, padded "
              f"{b['padded_over_held']:7.1f} x held ({b['padded_over_flex']:.1f} x flex)")
    grouped = grouped_reads()
    print(f"8-token blocks under a 16-position mask: {grouped['in_order']['over_held']:.3f} x "
          f"held in order, {grouped['fragmented']['over_held']:.3f} x fragmented")
    checks = equality()
    for check in checks:
        print(f"CPU, window {check['sliding_window']}: max |flex - decode_attention| "
              f"{check['max_abs_difference']:.2e}")
    on_gpu = cuda_step() if args.cuda else None
    if on_gpu:
        print(f"CUDA, {on_gpu['rows']} rows at {on_gpu['context']}: padded "
              f"{on_gpu['padded_ms']} ms, flex {on_gpu['flex_ms']} ms, max |difference| "
              f"{on_gpu['max_abs_difference']:.2e}")
    out = args.out or default_result_path("attention_traffic")
    write_json(out, {
        "benchmark": "attention_traffic", **provenance(),
        "machine": machine_info(),
        "lengths": f"{SHORTEST} to {LONGEST} tokens, uniform, seed {SEED}",
        "positions": "KV positions read per decode step, per KV head and layer",
        "target": "flex_over_held <= 1.1 (issue 50)",
        "batches": batches, "unsupported_block_size": grouped, "cpu_equality": checks,
        "cuda_step": on_gpu})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
