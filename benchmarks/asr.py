"""The asr workload's batching and serving on connected digits: padding and throughput of
duration buckets against random batches of the same mean size, and the server's inverse
real-time factor (audio seconds transcribed per second of wall time) on one core.

Batching: both schemes cover the same training utterances; the padding fraction is over a
whole epoch's batches, the throughput over ``--steps`` training steps (forward, CTC,
backward, AdamW) of the same model from the same weights, the audio read and padded before
timing. Serving: the validation utterances in batches of up to ``--serve-batch`` clips
grouped by padded length, as the server groups them, through the transcription codec
(greedy decoding and word timings included), one torch thread. With ``--run`` the trained
weights of that run are used; without, fresh ones (the compute is the same).

    python scripts/connected_digits.py --recordings ../shared/data/fsdd/recordings --out DIR
    python benchmarks/asr.py --data-dir DIR
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import default_result_path, machine_info, package_version, provenance, write_json

from gpuflow.data.duration_buckets import bucket_batches, padding_fraction
from gpuflow.serving import length_bucket
from gpuflow.workload import Workload, resolve_workload
from gpuflow.workloads.asr_codec import TranscriptionCodec


def random_batches(count: int, mean_size: float, seed: int) -> list[list[int]]:
    """Every index once, shuffled, cut into batches of ``mean_size`` on average."""
    order = np.random.default_rng(seed).permutation(count).tolist()
    cuts = np.round(np.arange(0, count + 1e-9, mean_size)).astype(int).tolist()
    return [order[a:b] for a, b in zip(cuts, [*cuts[1:], count], strict=False) if b > a]


def time_steps(workload: Workload, batches: list[list[int]], steps: int,
               state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Training steps over the first ``steps`` batches, from the weights ``state``."""
    model, dataset = workload.model, workload.train_dataset
    model.load_state_dict(state)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loaded = [workload.collate([dataset[i] for i in batch]) for batch in batches[:steps + 1]]
    audio = chars = padded = 0.0
    elapsed = 0.0
    for number, ((waves, lengths), target) in enumerate(loaded):
        start = time.perf_counter()
        loss = workload.loss_fn(model(waves, lengths), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if number == 0:
            continue  # the first step warms up the allocator and kernels
        elapsed += time.perf_counter() - start
        audio += float(lengths.sum()) / 16000
        padded += waves.numel() / 16000
        chars += float((target >= 0).sum())
    return {"steps": len(loaded) - 1, "wall_s": elapsed, "audio_s_per_s": audio / elapsed,
            "chars_per_s": chars / elapsed, "step_padding_fraction": 1 - audio / padded}


def batching(workload: Workload, batch_seconds: float, steps: int,
             seed: int) -> dict[str, Any]:
    durations = workload.train_dataset.durations()  # type: ignore[attr-defined]
    buckets = bucket_batches(durations, batch_seconds, seed)
    mean = len(durations) / len(buckets)
    shuffled = random_batches(len(durations), mean, seed)
    order = np.random.default_rng([seed, 1]).permutation(len(buckets)).tolist()
    state = {k: v.clone() for k, v in workload.model.state_dict().items()}
    result: dict[str, Any] = {"mean_batch_utterances": mean, "batches": len(buckets)}
    for name, batches in (("duration_buckets", [buckets[i] for i in order]),
                          ("random", shuffled)):
        print(f"batching: {name} ...", flush=True)
        result[name] = {"epoch_padding_fraction": padding_fraction(durations, batches),
                        **time_steps(workload, batches, steps, state)}
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
    clips = [workload.val_dataset[i][0][0] for i in range(len(workload.val_dataset))]  # type: ignore[arg-type]
    groups: dict[int, list[torch.Tensor]] = {}
    for clip in clips:
        groups.setdefault(length_bucket(len(clip), codec.SHORTEST, codec.longest), []).append(clip)
    codec.run(model, ("audio", codec.SHORTEST), [clips[0][: codec.SHORTEST]])  # warm-up
    start = time.perf_counter()
    for padded, rows in groups.items():
        for i in range(0, len(rows), serve_batch):
            codec.run(model, ("audio", padded), rows[i:i + serve_batch])
    wall = time.perf_counter() - start
    audio = sum(len(c) for c in clips) / codec.sample_rate
    return {"utterances": len(clips), "audio_s": audio, "wall_s": wall,
            "inverse_real_time_factor": audio / wall, "threads": 1, "max_batch": serve_batch}


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
