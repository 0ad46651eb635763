"""A linear layer's product on one CPU core, over the weight's usual layout (``[out, in]``
row-major: ``x @ W.T``, as ``F.linear`` computes it), input-major (``[in, out]``
row-major: ``x @ W``, the layout the generation engine gives fp32 weights on the CPU) and
prepacked for oneDNN (``mkldnn._linear_pointwise``, which the engine's fp32 steps of more
than one row take on the CPU; ``serve/generate/fused.py``).

A decode step multiplies a few rows (one a sequence) by every weight of the model. Two
settings: each of SmolLM2-135M's five products alone (its weight in cache after the first
call: the kernel's speed), and the whole 30-layer model's products in a row, each weight
its own (540 MB in fp32: read from memory, as a served model's are). Per dtype, layout and
rows, the median of interleaved rounds, and each layout's speed-up over the usual one
(above 1: faster); oneDNN's prepacked layout for fp32 only.

    .venv/bin/python benchmarks/linear_layout.py            # ~3 minutes
    .venv/bin/python benchmarks/linear_layout.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import default_result_path, machine_info, provenance, write_json  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query and 3 key/value heads of 64, MLP 1,536, 49,152 tokens,
# 30 layers; a layer's query/key/value and gate/up projections fused, as the engine runs them.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
LAYERS = 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# Each layout: how a weight is laid out from its usual ``[out, in]``, and how ``x`` multiplies it.
LAYOUTS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor],
                         Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = {
    "usual": (lambda w: w, lambda x, w: torch.mm(x, w.t())),
    "input_major": (lambda w: w.t().contiguous(), torch.mm),
    "onednn_packed": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
                      lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [],
                                                                      "")),
}


def products(weights: list[torch.Tensor], rows: int, layout: str) -> Callable[[], None]:
    """One pass of ``rows`` rows through each weight, in ``layout``."""
    lay_out, multiply = LAYOUTS[layout]
    laid = [lay_out(w) for w in weights]
    inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights]

    def run() -> None:
        for x, w in zip(inputs, laid, strict=True):
            multiply(x, w)
    return run


def timed(run: Callable[[], None], repeats: int) -> float:
    run()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats


def compare(weights: list[torch.Tensor], rows: int, rounds: int, repeats: int
            ) -> dict[str, float]:
    """Median milliseconds of a pass in each layout, rounds interleaved, and each layout's
    speed-up over the usual one."""
    layouts = ["usual", "input_major"] + (
        ["onednn_packed"] if weights[0].dtype == torch.float32 else [])
    runs = {name: products(weights, rows, name) for name in layouts}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(timed(run, repeats))
    ms = {name: 1000 * statistics.median(found) for name, found in times.items()}
    return {**{f"{name}_ms": value for name, value in ms.items()},
            **{f"speedup_{name}": ms["usual"] / ms[name] for name in layouts[1:]}}


def model_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """Every product's weight of a SmolLM2-shaped model, each its own tensor."""
    layer = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]
    return [torch.randn(shape, dtype=dtype) for _ in range(LAYERS) for shape in layer] + [
        torch.randn(SHAPES["head"], dtype=dtype)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32,128")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 and 8 rows, 2 rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds = "1,8", 2
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for dtype_name, dtype in DTYPES.items():
        by_setting: dict[str, dict[str, dict[str, float]]] = {}
        for name, shape in SHAPES.items():
            weight = [torch.randn(shape, dtype=dtype)]
            by_setting[name] = {str(r): compare(weight, r, args.rounds, 20) for r in rows}
        whole = model_weights(dtype)
        by_setting["model"] = {str(r): compare(whole, r, args.rounds, 2) for r in rows}
        del whole
        results[dtype_name] = by_setting
        for setting, by_rows in by_setting.items():
            print(f"{dtype_name} {setting:8} " + "  ".join(
                f"{r}: " + "/".join(f"{v[k]:.2f}x" for k in v if k.startswith("speedup"))
                for r, v in by_rows.items()), flush=True)
    out = args.out or default_result_path("linear_layout")
    write_json(out, {**provenance(), "machine": machine_info(), "threads": 1,
                     "shapes": {k: list(v) for k, v in SHAPES.items()}, "layers": LAYERS,
                     "rounds": args.rounds, "results": results})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
