"""The GPU's `images` stage: can JPEG decoding on the CPU keep a ResNet-50 busy?

ResNet-50, bf16, channels_last inputs, ``--compile``, trained by ``gpuflow train`` from tar
shards of JPEGs (ImageNet-sized, made from scikit-learn's photos by random crops, rescaling
and colour shifts, quality 90) with the machine's cores as loader workers (CPU decode),
against the same model on ``--data synthetic`` (uint8 images already decoded in memory: no
decode at all). The target: the JPEG run reaches >= 90% of the synthetic images/s, its data
wait at most 5% of the step. The same shards are trained again with ``--decode gpu``
(nvImageCodec decodes each batch on the GPU; the workers only read and draw the crops), side
by side with ``--decode cpu``, each with its ratio to synthetic and the samples decoded on the
device and on the CPU; where GPU decode cannot run, the reason is recorded.

Run on the GPU machine: ``python benchmarks/gpu_images.py`` (about 5 minutes on an H200);
without a registry there, carry ``.wheels`` (``bash benchmarks/gpu_wheels.sh``) and put
nvImageCodec on the path first (docs/workloads/images.md, "Where JPEGs are decoded");
``--dry-run`` runs the same code at toy sizes on a CPU. Writes
``benchmarks/results/gpu_images-<machine>.json`` (a dry run: under a temporary folder).
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
import _common  # noqa: E402
from image_loader import SETS, make_set  # noqa: E402

from gpuflow.data.image_sources import scan, shard_tree  # noqa: E402

TARGET_RATIO, TARGET_WAIT = 0.90, 0.05
FULL = {"images": 4096, "model": "resnet50", "size": 224, "batch": 256, "steps": 60,
        "log_every": 10, "flags": ["--precision", "bf16", "--compile"]}
DRY = {"images": 64, "model": "resnet18,width=8", "size": 32, "batch": 8, "steps": 6,
       "log_every": 2, "flags": ["--device", "cpu"]}


def train(data: list[str], settings: dict[str, Any], workers: int, run_dir: Path,
          *extra: str) -> dict[str, Any]:
    """One `gpuflow train` run: its median figures, or why it did not finish."""
    command = [sys.executable, "-m", "gpuflow.cli", "train", "--workload", "images", *data,
               "--model-size", settings["model"], "--image-size", str(settings["size"]),
               "--batch-size", str(settings["batch"]), "--max-steps", str(settings["steps"]),
               "--log-every", str(settings["log_every"]), "--eval-every", "0",
               "--num-workers", str(workers), "--no-progress", "--run-dir", str(run_dir),
               *settings["flags"], *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"ok": False, "exit_code": done.returncode,
                "error": (done.stderr or done.stdout)[-1500:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    median = summary["median"]
    return {"ok": True, "images_per_s": median["samples_per_s"],
            "data_wait_frac": median["data_wait_frac"], "step_time_s": median["step_time_s"],
            "mfu": median.get("mfu"), "data": summary.get("data"),
            "device_name": summary["device_name"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes, on the CPU")
    parser.add_argument("--workers", type=int, default=_common.usable_cores(),
                        help="loader worker processes (default: every usable core)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    settings = DRY if args.dry_run else FULL
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out = args.out or (work / "gpu_images.json" if args.dry_run
                           else _common.default_result_path("gpu_images"))
        tree = make_set(work / "jpeg", SETS["imagenet-sized"], settings["images"], seed=0)
        shard_tree(scan(tree, val_percent=0), work / "shards", per_shard=512)
        shards = ["--data-dir", str(work / "shards")]
        runs = {
            "synthetic": train(["--data", "synthetic"], settings, args.workers,
                               work / "synthetic"),
            "jpeg_cpu_decode": train(shards, settings, args.workers, work / "cpu",
                                     "--decode", "cpu"),
            "jpeg_gpu_decode": train(shards, settings, args.workers, work / "gpu",
                                     "--decode", "gpu"),
        }
        synthetic, cpu = runs["synthetic"], runs["jpeg_cpu_decode"]
        ratios = {name: (run["images_per_s"] / synthetic["images_per_s"]
                         if run["ok"] and synthetic["ok"] else None)
                  for name, run in runs.items() if name != "synthetic"}
        ratio = ratios["jpeg_cpu_decode"]
        _common.write_json(out, {
            "benchmark": "gpu_images", **_common.provenance(),
            "machine": _common.machine_info(), "dry_run": args.dry_run,
            "settings": {**settings, "workers": args.workers, "image": SETS["imagenet-sized"]},
            "runs": runs,
            "jpeg_over_synthetic": ratio,
            "over_synthetic": ratios,
            "targets": {"ratio": TARGET_RATIO, "data_wait_frac": TARGET_WAIT},
            "met": None if ratio is None else (
                ratio >= TARGET_RATIO and cpu["data_wait_frac"] <= TARGET_WAIT),
        })
        for name, run in runs.items():
            print(f"{name}: " + (f"{run['images_per_s']:.1f} images/s, data wait "
                                 f"{100 * run['data_wait_frac']:.1f}%" if run["ok"]
                                 else f"did not run: {run['error'].strip().splitlines()[-1]}"))
        for name, value in ratios.items():
            print(f"{name} / synthetic: {value if value is None else f'{value:.2f}'} "
                  f"(target >= {TARGET_RATIO})")
        print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
