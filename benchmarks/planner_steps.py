"""The planner's step times against measured ones on this CPU: orders and a calibration.

Step times move 2-3x with the load on a shared machine, so no test asserts on them; this
script measures them, each comparison in one window with the contenders taking turns and
the fastest step counting (load only ever slows a step), and records the planner's
predictions beside them with a verdict per comparison:

- precision: one process, textlm 2x512 (seq 128), fp32 against bf16 autocast, predicted
  with this CPU's measured peaks (AMX makes bf16 matmuls several times faster);
- two_ranks: ddp, fsdp (per block, without resharding, as one unit) and tp on 2 gloo ranks,
  textlm 2x64 at global batch 8: every pair measured more than 25% apart must be predicted
  in the same order;
- compute_bound: ddp, fsdp and a 2-stage pipeline with one micro-batch, textlm 4x256 (seq
  128) at global batch 8, where compute dominates the frameworks' per-call costs;
- calibration: the efficiency of one configuration (``--measure``'s method) predicting the
  step of two others, the ratio of predicted to measured recorded.

Run: ``python benchmarks/planner_steps.py`` (1-2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))  # planner_layouts: the layouts' training steps

import _common  # noqa: E402
from planner_layouts import (  # noqa: E402
    COMPUTE_BOUND_LAYOUTS,
    MEDIUM_GPT,
    SMALL_GPT,
    TIMED_LAYOUTS,
    batch_of,
    fastest_step_s,
    strategy_step,
    workload_of,
)

from gpuflow.config import TrainConfig  # noqa: E402
from gpuflow.devices import cpu_peak, total_memory  # noqa: E402
from gpuflow.parallel.env import free_port  # noqa: E402
from gpuflow.planner.cost import predict_step_time  # noqa: E402
from gpuflow.planner.layout import Layout  # noqa: E402
from gpuflow.planner.machine import cpu_hardware  # noqa: E402
from gpuflow.planner.workload_profile import profile_workload  # noqa: E402
from gpuflow.train.calibrate import measure_efficiency  # noqa: E402
from gpuflow.train.optim import build_optimizer  # noqa: E402
from gpuflow.workload import resolve_workload  # noqa: E402

APART = 1.25  # pairs closer than this are within the machine's noise and not ranked
PRECISION_GPT = "layers=2,dim=512,heads=4,seq=128"
CALIBRATED = ("layers=2,dim=64,heads=2,seq=32", 4)
PREDICTED = (("layers=2,dim=64,heads=2,seq=32", 16), ("layers=4,dim=128,heads=2,seq=64", 4))


def _ranked(measured: dict[str, float], predicted: dict[str, float]) -> dict[str, Any]:
    """Every pair measured more than APART apart, and whether the prediction orders it so."""
    pairs = [{"slower": a, "faster": b, "predicted_in_order": predicted[a] > predicted[b]}
             for a in measured for b in measured if measured[a] > APART * measured[b]]
    return {"measured_s": measured, "predicted_s": predicted, "pairs": pairs,
            "all_in_order": all(p["predicted_in_order"] for p in pairs)}


def precision() -> dict[str, Any]:
    """fp32 against bf16 in one process, taking turns, fastest of five after one each."""
    workload = workload_of("textlm", PRECISION_GPT)
    peaks = {key: cpu_peak(key).flops or 1.0 for key in ("fp32", "bf16")}
    hardware = cpu_hardware(1, peaks, 2**34)
    optimizer = build_optimizer(workload.model, TrainConfig(), torch.device("cpu"))
    batch = batch_of(workload, 4)

    def step(key: str) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=key == "bf16"):
            loss = workload.loss_fn(workload.model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for round_ in range(6):
        for key in times:
            start = time.perf_counter()
            step(key)
            if round_:
                times[key].append(time.perf_counter() - start)
    measured = {key: min(seconds) for key, seconds in times.items()}
    predicted = {key: predict_step_time(profile_workload(workload, key),
                                        Layout(strategy="single", precision=key,
                                               micro_batch=4), hardware).step_s
                 for key in times}
    return {"model_size": PRECISION_GPT, "micro_batch": 4, "peaks_flops": peaks,
            **_ranked(measured, predicted)}


def _groups() -> dict[str, tuple[str, dict[str, Layout]]]:
    """The 2-rank comparisons: a model size and the layouts timed at it."""
    return {"two_ranks": (SMALL_GPT, TIMED_LAYOUTS),
            "compute_bound": (MEDIUM_GPT, COMPUTE_BOUND_LAYOUTS)}


def _worker(rank: int, port: int, out: str, group: str, rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    size, layouts = _groups()[group]
    steps = {}
    for name, layout in layouts.items():
        workload = workload_of("textlm", size)
        forward_backward, local = strategy_step(workload, layout)
        optimizer = build_optimizer(local, TrainConfig(), torch.device("cpu"))
        steps[name] = (forward_backward, optimizer,
                       batch_of(workload, layout.samples_per_step // layout.dp))
    Path(f"{out}.{rank}").write_text(json.dumps(fastest_step_s(steps, rounds, warmup=1)))
    dist.destroy_process_group()


def two_ranks(group: str, peak: float, rounds: int) -> dict[str, Any]:
    """Each layout's fastest step on 2 gloo ranks (the slower rank's), and the predictions."""
    size, layouts = _groups()[group]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "steps")
        mp.spawn(_worker, args=(free_port(), out, group, rounds), nprocs=2)
        ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    measured = {name: max(steps[name] for steps in ranks) for name in layouts}
    profile = profile_workload(workload_of("textlm", size), "fp32")
    hardware = cpu_hardware(2, {"fp32": peak}, 2**34)
    predicted = {name: predict_step_time(profile, layout, hardware).step_s
                 for name, layout in layouts.items()}
    return {"model_size": size, "fp32_peak_flops": peak, **_ranked(measured, predicted)}


def calibration() -> dict[str, Any]:
    """The efficiency measured on CALIBRATED, and the steps it predicts for PREDICTED."""
    def measured(size: str, micro_batch: int) -> Any:
        spec = {"data": "synthetic", "model_size": size}
        return measure_efficiency(resolve_workload("textlm", spec), "fp32", micro_batch,
                                  device="cpu", steps=12)

    base = measured(*CALIBRATED)
    peaks = {key: cpu_peak(key).flops for key in ("fp32", "tf32", "bf16", "fp16")}
    hardware = cpu_hardware(1, peaks, total_memory() or 2**34, efficiency=base.efficiency)
    rows = []
    for size, micro_batch in PREDICTED:
        with torch.device("meta"):
            workload = resolve_workload("textlm", {"data": "synthetic", "model_size": size})
        predicted = predict_step_time(profile_workload(workload, "fp32"),
                                      Layout(strategy="single", micro_batch=micro_batch),
                                      hardware).step_s
        step = measured(size, micro_batch).step_time_s
        rows.append({"model_size": size, "micro_batch": micro_batch, "predicted_s": predicted,
                     "measured_s": step, "predicted_over_measured": predicted / step})
    return {"calibrated_on": {"model_size": CALIBRATED[0], "micro_batch": CALIBRATED[1],
                              "efficiency": base.efficiency, "step_s": base.step_time_s},
            "predictions": rows,
            "median_predicted_over_measured": statistics.median(
                r["predicted_over_measured"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per layout")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.monotonic()
    load = _common.ForeignLoad(include_children=True)
    torch.set_num_threads(1)
    one_thread_peak = cpu_peak("fp32").flops or 1.0
    torch.set_num_threads(os.cpu_count() or 1)
    result = {
        "precision": precision(),
        # Every layout does the same FLOPs per rank at this size: the order rests on
        # communication, so the rate assumed does not matter.
        "two_ranks": two_ranks("two_ranks", 1e11, args.rounds),
        "compute_bound": two_ranks("compute_bound", one_thread_peak, args.rounds),
        "calibration": calibration(),
    }
    verdicts = [f"{name}: {'every' if result[name]['all_in_order'] else 'not every'} pair "
                f"measured over {APART}x apart predicted in order "
                f"({len(result[name]['pairs'])} pairs)"
                for name in ("precision", "two_ranks", "compute_bound")]
    payload = {"benchmark": "planner_steps", **_common.provenance(),
               "machine": _common.machine_info(), "settings": {"rounds": args.rounds},
               "foreign_cpu_share": load.share(), "wall_s": time.monotonic() - started,
               **result, "verdicts": verdicts}
    out = args.out or _common.default_result_path("planner_steps")
    _common.write_json(out, payload)
    for verdict in verdicts:
        print(verdict)
    print(f"calibration: predicted/measured median "
          f"{result['calibration']['median_predicted_over_measured']:.2f}; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
