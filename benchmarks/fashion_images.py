"""Fashion-MNIST from JPEG class folders with ResNet-18: the accuracy the images workload reaches.

Writes Debian's Fashion-MNIST (``dataset-fashion-mnist``) as JPEG folders with
``scripts/fashion_mnist_jpeg.py`` (60,000 training and 10,000 test photos), then trains the
``images`` workload, ``resnet18`` at 28 pixels (the small-image stem), from those files, as a
user runs it (``gpuflow train`` in a subprocess). The target is >= 93% validation accuracy;
the result records it with the wall time and the median data wait.

Run: ``python benchmarks/fashion_images.py`` (on a GPU: minutes; on 2 CPU cores: many hours);
``--quick`` (2,000 photos a split, one epoch, a narrow network) checks the code path and
writes its result under a temporary folder unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402

SCRIPT = HERE.parent / "scripts" / "fashion_mnist_jpeg.py"
TARGET = 0.93
FULL = {"limit": None, "epochs": "12", "model": "resnet18", "batch": "256", "lr": "0.003",
        "flags": ["--precision", "bf16"]}
QUICK = {"limit": 2000, "epochs": "1", "model": "resnet18,width=16", "batch": "64",
         "lr": "0.003", "flags": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=_common.usable_cores())
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out = args.out or (work / "fashion_images.json" if args.quick
                           else _common.default_result_path("fashion_images"))
        limit = [] if settings["limit"] is None else ["--limit", str(settings["limit"])]
        subprocess.run([sys.executable, str(SCRIPT), "--out", str(work / "jpeg"), *limit],
                       check=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "gpuflow.cli", "train", "--workload", "images",
                        "--data-dir", str(work / "jpeg"), "--image-size", "28",
                        "--model-size", settings["model"], "--epochs", settings["epochs"],
                        "--batch-size", settings["batch"], "--lr", settings["lr"],
                        "--num-workers", str(args.workers), "--eval-every", "0",
                        "--no-progress", "--run-dir", str(work / "run"), *settings["flags"]],
                       check=True)
        wall = time.perf_counter() - started
        summary = json.loads((work / "run" / "summary.json").read_text())
        accuracy = summary["final_metrics"]["val_accuracy"]
        _common.write_json(out, {
            "benchmark": "fashion_images", **_common.provenance(),
            "machine": _common.machine_info(), "quick": args.quick,
            "settings": {**settings, "workers": args.workers, "image_size": 28},
            "val_accuracy": accuracy, "target": TARGET, "met": accuracy >= TARGET,
            "wall_time_s": wall, "train_wall_time_s": summary["wall_time_s"],
            "median": summary["median"], "data": summary["data"],
            "device_name": summary["device_name"],
        })
        print(f"validation accuracy {100 * accuracy:.2f}% (target {100 * TARGET:.0f}%) in "
              f"{wall:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
