"""Leave-one-speaker-out accuracy of the speech workload: how it hears voices it never heard.

Each fold runs the default training command with one speaker held out
(``gpuflow train --workload speech --data-dir DIR --val-speakers NAME``) and reads the held-out
accuracy from the run's ``summary.json``; the result file holds every fold, their mean and
the worst, each run's wall time, and (unless ``--no-same-speaker``) the same-speaker figure
of ``--val-speakers none`` as a second line.

    python benchmarks/speech_speakers.py                      # every speaker, seed 0
    python benchmarks/speech_speakers.py --seeds 0 1 --jobs 2 # two folds at a time
    python benchmarks/speech_speakers.py -- --model-size base # extra `gpuflow train` flags
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import default_result_path, machine_info, provenance, write_json

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "fsdd" / "recordings"


def speakers_in(data_dir: Path) -> list[str]:
    """Speaker names of the ``{digit}_{speaker}_{take}.wav`` files in ``data_dir``."""
    sys.path.insert(0, str(ROOT / "src"))
    from gpuflow.data.audio import find_clips

    clips, _ = find_clips(data_dir)
    return sorted({clip.speaker for clip in clips})


def run_fold(data_dir: Path, held_out: str, seed: int, extra: list[str],
             threads: int | None, scratch: Path) -> dict[str, Any]:
    """One training run validated on ``held_out`` (a speaker, or ``none``)."""
    run_dir = scratch / f"{held_out}-seed{seed}"
    command = [sys.executable, "-m", "gpuflow.cli", "train", "--workload", "speech",
               "--data-dir", str(data_dir), "--val-speakers", held_out, "--seed", str(seed),
               "--run-dir", str(run_dir), "--no-checkpoints", "--no-progress", *extra]
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"fold {held_out} (seed {seed}) failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"held_out": held_out, "seed": seed,
            "accuracy": summary["final_metrics"]["val_accuracy"],
            "val_loss": summary["final_metrics"]["val_loss"], "steps": summary["steps"],
            "median_step_s": summary["median"]["step_time_s"], "command_wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--speakers", nargs="+", help="folds to run (default: every speaker)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--threads", type=int,
                        help="OMP_NUM_THREADS of each run (default: gpuflow's own choice)")
    parser.add_argument("--no-same-speaker", dest="same_speaker", action="store_false",
                        help="skip the --val-speakers none run")
    parser.add_argument("--out", type=Path, default=default_result_path("speech-speakers"))
    parser.add_argument("extra", nargs="*", help="after --: more `gpuflow train` flags")
    args = parser.parse_args()
    if not args.data_dir.is_dir():
        raise SystemExit(f"--data-dir {args.data_dir} is not a folder of FSDD recordings.")
    speakers = args.speakers or speakers_in(args.data_dir)
    folds = [(name, seed) for seed in args.seeds for name in speakers]
    if args.same_speaker:
        folds += [("none", seed) for seed in args.seeds]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="speech-speakers-") as scratch, \
            ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda fold: run_fold(args.data_dir, *fold, args.extra,
                                                   args.threads, Path(scratch)), folds))
    for run in runs:
        print(f"{run['held_out']:>10} seed {run['seed']}: {run['accuracy']:.1%} "
              f"({run['command_wall_s']:.0f} s)", flush=True)
    held = [run for run in runs if run["held_out"] != "none"]
    per_speaker = {name: statistics.mean(r["accuracy"] for r in held if r["held_out"] == name)
                   for name in speakers}
    same = [run["accuracy"] for run in runs if run["held_out"] == "none"]
    figures = {
        "per_speaker": per_speaker,
        "mean": statistics.mean(per_speaker.values()),
        "worst": min(per_speaker.values()),
        "worst_speaker": min(per_speaker, key=per_speaker.__getitem__),
        "same_speaker": statistics.mean(same) if same else None,
        "median_run_wall_s": statistics.median(r["command_wall_s"] for r in runs),
    }
    write_json(args.out, {
        "benchmark": "speech-speakers",
        **provenance(),
        "settings": {"data_dir": str(args.data_dir), "speakers": speakers, "seeds": args.seeds,
                     "jobs": args.jobs, "threads": args.threads, "extra_flags": args.extra},
        "figures": figures,
        "runs": runs,
        "total_wall_s": time.perf_counter() - start,
        "machine": machine_info(),
    })
    print(f"mean {figures['mean']:.1%}, worst {figures['worst']:.1%} "
          f"({figures['worst_speaker']}); same-speaker {figures['same_speaker']}")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
