"""The asr workload's batching and serving on connected digits: padding and throughput of
duration buckets against random batches of the same mean size, and the server's inverse
real-time factor (audio seconds transcribed per second of wall time) on one core.

Batching: both schemes cover the same training utterances; the padding fraction is over a
whole epoch's batches, the throughput over ``--steps`` training steps (forward, CTC,
backward, AdamW) of the same model from the same weights, the audio read and padded before
timing, the two schemes' steps taken in turn. Serving: the validation utterances in
batches of up to ``--serve-batch`` clips grouped by padded length, as the server groups
them, through the transcription codec (greedy decoding and word timings included), one
torch thread. With ``--run`` the trained
weights of that run are used; without, fresh ones (the compute is the same).

    python scripts/connected_digits.py --recordings ../shared/data/fsdd/recordings --out DIR
    python benchmarks/asr.py --data-dir DIR
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import (
    ForeignLoad,
    default_result_path,
    machine_info,
    package_version,
    provenance,
    write_json,
)

from gpuflow.data.duration_buckets import bucket_batches, padding_fraction
from gpuflow.workload import Workload, resolve_workload
from gpuflow.workloads.asr_codec import TranscriptionCodec


def random_batches(count: int, mean_size: float, seed: int) -> list[list[int]]:
    """Every index once, shuffled, cut into batches of ``mean_size`` on average."""
    order = np.random.default_rng(seed).permutation(count).tolist()
    cuts = np.round(np.arange(0, count + 1e-9, mean_size)).astype(int).tolist()
    return [order[a:b] for a, b in zip(cuts, [*cuts[1:], count], strict=False) if b > a]


class Scheme:
    """One batching scheme's training steps: its own copy of the model and optimizer, and
    its batches read and padded ahead of timing."""

    def __init__(self, workload: Workload, batches: list[list[int]], steps: int) -> None:
        self.model = copy.deepcopy(workload.model).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.loss_fn = workload.loss_fn
        dataset = workload.train_dataset
        self.loaded = [workload.collate([dataset[i] for i in batch])
                       for batch in batches[:steps + 1]]
        self.audio = self.chars = self.padded = self.wall = 0.0

    def step(self, number: int) -> None:
        """Step ``number``; the first warms up the allocator and kernels, untimed."""
        (waves, lengths), target = self.loaded[number]
        start = time.perf_counter()
        loss = self.loss_fn(self.model(waves, lengths), target)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if number == 0:
            return
        self.wall += time.perf_counter() - start
        self.audio += float(lengths.sum()) / 16000
        self.padded += waves.numel() / 16000
        self.chars += float((target >= 0).sum())

    def figures(self) -> dict[str, float]:
        return {"steps": len(self.loaded) - 1, "wall_s": self.wall,
                "audio_s_per_s": self.audio / self.wall, "chars_per_s": self.chars / self.wall,
                "step_padding_fraction": 1 - self.audio / self.padded}


def batching(workload: Workload, batch_seconds: float, steps: int,
             seed: int) -> dict[str, Any]:
    """Both schemes from the same weights, their steps interleaved so that a change in the
    machine's load falls on both alike."""
    durations = workload.train_dataset.durations()  # type: ignore[attr-defined]
    buckets = bucket_batches(durations, batch_seconds, seed)
    mean = len(durations) / len(buckets)
    order = np.random.default_rng([seed, 1]).permutation(len(buckets)).tolist()
    plans = {"duration_buckets": [buckets[i] for i in order],
             "random": random_batches(len(durations), mean, seed)}
    schemes = {name: Scheme(workload, batches, steps) for name, batches in plans.items()}
    load = ForeignLoad()
    for number in range(steps + 1):
        for scheme in schemes.values():
            scheme.step(number)
    result: dict[str, Any] = {"mean_batch_utterances": mean, "batches": len(buckets),
                              "foreign_cpu_share": load.share(),
                              "torch_threads": torch.get_num_threads()}
    for name, scheme in schemes.items():
        result[name] = {"epoch_padding_fraction": padding_fraction(durations, plans[name]),
                        **scheme.figures()}
    result["throughput_gain"] = (result["duration_buckets"]["audio_s_per_s"]
                                 / result["random"]["audio_s_per_s"])
    return result


@torch.inference_mode()
def serving(workload: Workload, serve_batch: int) -> dict[str, Any]:
    """Inverse real-time factor of the transcription codec over the validation set."""
    torch.set_num_threads(1)
    model = workload.model.eval()
    state = dict(workload.serving.state)  # type: ignore[union-attr]
    codec = workload.serving.codec(model, state)  # type: ignore[union-attr]
    assert isinstance(codec, TranscriptionCodec)
    val = workload.val_dataset
    clips = [val[i][0][0] for i in range(len(val))]  # type: ignore[arg-type]
    groups: dict[Hashable, list[Any]] = {}
    for clip in clips:
        decoded = codec.clips([clip])
        groups.setdefault(decoded.key, []).extend(decoded.rows)
    key, row = codec.warmup_rows()[0]
    codec.run(model, key, [row])  # warm-up
    load = ForeignLoad()
    start = time.perf_counter()
    for key, rows in groups.items():
        for i in range(0, len(rows), serve_batch):
            codec.run(model, key, rows[i:i + serve_batch])
    wall = time.perf_counter() - start
    audio = sum(len(c) for c in clips) / codec.sample_rate
    return {"utterances": len(clips), "audio_s": audio, "wall_s": wall,
            "inverse_real_time_factor": audio / wall, "threads": 1, "max_batch": serve_batch,
            "foreign_cpu_share": load.share()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True,
                        help="a connected-digit set (scripts/connected_digits.py)")
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--batch-seconds", type=float, default=60.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--serve-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", type=Path, help="serve this run's trained weights")
    parser.add_argument("--out", type=Path, default=default_result_path("asr"))
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workload = resolve_workload("asr", {"data_dir": str(args.data_dir),
                                            "model_size": args.model_size,
                                            "batch_seconds": args.batch_seconds})
    figures = {"batching": batching(workload, args.batch_seconds, args.steps, args.seed)}
    if args.run is not None:
        from gpuflow.serve.model import newest_run_weights

        workload.model.load_state_dict(newest_run_weights(args.run)[0])
    figures["serving"] = serving(workload, args.serve_batch)
    write_json(args.out, {
        "benchmark": "asr",
        **provenance(jiwer=package_version("jiwer"), soundfile=package_version("soundfile")),
        "settings": {"data_dir": str(args.data_dir), "model_size": args.model_size,
                     "batch_seconds": args.batch_seconds, "steps": args.steps,
                     "serve_batch": args.serve_batch, "seed": args.seed,
                     "run": str(args.run) if args.run else None,
                     "train_utterances": len(workload.train_dataset),  # type: ignore[arg-type]
                     "val_utterances": len(workload.val_dataset)},  # type: ignore[arg-type]
        "figures": figures, "machine": machine_info()})
    batch = figures["batching"]
    print(f"padding: buckets {batch['duration_buckets']['epoch_padding_fraction']:.1%}, "
          f"random {batch['random']['epoch_padding_fraction']:.1%}; throughput gain "
          f"{batch['throughput_gain']:.2f}x; serving "
          f"{figures['serving']['inverse_real_time_factor']:.0f}x real time on one thread")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
