"""Leave-one-speaker-out word error rate of the asr workload on connected digits, greedy and
with the ten digit words as a lexicon, beside the isolated-digit speech workload's error on
the same held-out speakers.

Each fold runs ``gpuflow train --workload asr --data-dir DIR --val-speakers NAME --seed S``
(plus any flags after ``--``), then decodes the held-out speaker's utterances with the
run's final weights: greedy (the run's own ``val_wer``) and a prefix beam of ``--beam``
constrained to the digit words. The isolated-digit figures are read from the
speech-speakers result file (``benchmarks/speech_speakers.py``) given by ``--isolated``.

    python scripts/connected_digits.py --recordings ../shared/data/fsdd/recordings --out DIR
    python benchmarks/asr_speakers.py --data-dir DIR --seeds 0 1 2
    python benchmarks/asr_speakers.py --data-dir DIR --speakers theo -- --epochs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, default_result_path, machine_info, provenance, write_json

from gpuflow.serve.model import newest_run_weights
from gpuflow.workload import IGNORE_INDEX
from gpuflow.workloads.asr import build as build_asr
from gpuflow.workloads.asr_decode import Lexicon, decode_batch, error_rate

ROOT = Path(__file__).resolve().parents[1]
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@torch.inference_mode()
def decode_fold(run_dir: Path, data_dir: Path, held_out: str, beam: int) -> dict[str, float]:
    """Greedy and lexicon WER of the run's final weights on the held-out utterances."""
    config = json.loads((run_dir / "config.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workload = build_asr(data_dir=str(data_dir), val_speakers=held_out,
                             model_size=config.get("model_size"))
    workload.model.load_state_dict(newest_run_weights(run_dir)[0])
    model = workload.model.eval()
    vocabulary = workload.train_dataset.vocabulary  # type: ignore[attr-defined]
    lexicon = Lexicon(DIGIT_WORDS, vocabulary)
    val = workload.val_dataset
    references, greedy, constrained = [], [], []
    for start in range(0, len(val), 16):  # type: ignore[arg-type]
        items = [val[i] for i in range(start, min(start + 16, len(val)))]  # type: ignore[arg-type]
        (waves, lengths), target = workload.collate(items)
        outputs = model(waves, lengths)
        references += [vocabulary.decode(r[r != IGNORE_INDEX].tolist()) for r in target]
        greedy += decode_batch(outputs["logits"], outputs["frames"], vocabulary)
        constrained += decode_batch(outputs["logits"], outputs["frames"], vocabulary, beam,
                                    lexicon)
    return {"wer_greedy": error_rate(references, greedy),
            "wer_lexicon": error_rate(references, constrained),
            "cer_greedy": error_rate(references, greedy, unit="char")}


def run_fold(data_dir: Path, held_out: str, seed: int, extra: list[str], beam: int,
             scratch: Path) -> dict[str, Any]:
    run_dir = scratch / f"{held_out}-seed{seed}"
    command = [sys.executable, "-m", "gpuflow.cli", "train", "--workload", "asr",
               "--data-dir", str(data_dir), "--val-speakers", held_out, "--seed", str(seed),
               "--run-dir", str(run_dir), "--no-progress", "--keep-checkpoints", "1", *extra]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"fold {held_out} (seed {seed}) failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    fold = {"held_out": held_out, "seed": seed, "steps": summary["steps"],
            "val_wer": summary["final_metrics"]["val_wer"], "command_wall_s": wall,
            **decode_fold(run_dir, data_dir, held_out, beam)}
    print(f"{held_out:>10} seed {seed}: WER {fold['wer_greedy']:.1%} greedy, "
          f"{fold['wer_lexicon']:.1%} with the lexicon ({wall:.0f} s)", flush=True)
    return fold


def isolated_errors(path: Path | None) -> dict[str, float] | None:
    """Per-speaker error of the isolated-digit speech workload, from its result file."""
    if path is None:
        found = sorted(RESULTS_DIR.glob("speech-speakers-*.json"))
        path = found[0] if found else None
    if path is None:
        return None
    accuracy = json.loads(path.read_text())["figures"]["per_speaker"]
    return {name: 1.0 - value for name, value in accuracy.items()}


def summarise(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    speakers = sorted({r["held_out"] for r in runs})
    per = {s: statistics.mean(r[key] for r in runs if r["held_out"] == s) for s in speakers}
    return {"per_speaker": per, "mean": statistics.mean(per.values()),
            "worst": max(per.values()), "worst_speaker": max(per, key=per.__getitem__)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--speakers", nargs="+",
                        default=["george", "jackson", "nicolas", "theo", "yweweler"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--beam", type=int, default=8)
    parser.add_argument("--isolated", type=Path, help="a speech-speakers result file")
    parser.add_argument("--out", type=Path, default=default_result_path("asr-speakers"))
    parser.add_argument("extra", nargs="*", help="after --: more `gpuflow train` flags")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="asr-speakers-") as scratch:
        runs = [run_fold(args.data_dir, name, seed, args.extra, args.beam, Path(scratch))
                for seed in args.seeds for name in args.speakers]
    figures = {"greedy": summarise(runs, "wer_greedy"),
               "lexicon": summarise(runs, "wer_lexicon"),
               "isolated_digit_error": isolated_errors(args.isolated)}
    write_json(args.out, {
        "benchmark": "asr-speakers", **provenance(),
        "settings": {"data_dir": str(args.data_dir), "speakers": args.speakers,
                     "seeds": args.seeds, "beam": args.beam, "extra_flags": args.extra},
        "figures": figures, "runs": runs, "total_wall_s": time.perf_counter() - start,
        "machine": machine_info()})
    print(f"WER mean {figures['greedy']['mean']:.1%} greedy, "
          f"{figures['lexicon']['mean']:.1%} with the lexicon -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
