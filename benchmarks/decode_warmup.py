"""How long the generation engine's compiled decode takes to warm up, cold and warm.

``gpuflow serve --compile`` compiles one decode step per batch bucket (1, 2, 4, ... up to
``--max-batch-size``) before the server is ready. This times that warm-up for textlm tiny
on one torch thread, each in a fresh process: first with an empty inductor cache (a first
start on a machine), then again over the cache that start left (a restart). Whether the
compiled decode can be the CPU's default hangs on these figures (the target: ~15 s).

    .venv/bin/python benchmarks/decode_warmup.py        # ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import default_result_path, machine_info, provenance, write_json  # noqa: E402

WARM_UP = """
import json, sys, torch
torch.set_num_threads(1)
from gpuflow.models.gpt import GPT
from gpuflow.serve.generate.models import GPTDecoder
from gpuflow.serve.generate.runner import ModelRunner
from gpuflow.workloads.textlm import parse_model_size
model = GPT(parse_model_size("tiny")).eval()
with torch.inference_mode():
    runner = ModelRunner(GPTDecoder(model, torch.float32), 64, 16, int(sys.argv[1]),
                         compile=True)
    runner.warm_up()
print(json.dumps({"buckets": runner.buckets, "warmup_s": runner.warmup_s,
                  "decode": runner.describe()}))
"""


def warm_up(max_batch_size: int, cache: Path) -> dict[str, Any]:
    """One fresh process's decode warm-up over ``cache`` (inductor's on-disk cache)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", WARM_UP, str(max_batch_size)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-batch-size", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {}
    for size in args.max_batch_size:
        with tempfile.TemporaryDirectory() as cache:
            cold = warm_up(size, Path(cache))
            warm = warm_up(size, Path(cache))
        results[str(size)] = {"buckets": cold["buckets"], "decode": cold["decode"],
                              "cold_s": round(cold["warmup_s"], 1),
                              "warm_cache_s": round(warm["warmup_s"], 1)}
        print(f"max batch {size:3}: buckets {cold['buckets']}, cold {cold['warmup_s']:.1f} s, "
              f"warm cache {warm['warmup_s']:.1f} s")
    out = args.out or default_result_path("decode_warmup")
    write_json(out, {"benchmark": "decode_warmup", **provenance(),
                     "machine": {**machine_info(), "torch_threads": 1},
                     "model": "textlm tiny (4 x 128, 128 context)", "results": results})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
