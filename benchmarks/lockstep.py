"""What running in step costs this machine's cores, with no communication at all.

Data-parallel ranks synchronise: DDP once per gradient bucket, FSDP at every all-gather and
reduce-scatter (three times per block per step). Between synchronisations the ranks run the
same kernels at the same moments; cores that share execution units, caches or memory
bandwidth slow each other down more when their phases line up than when they drift apart.
This benchmark measures that penalty alone: N processes (one thread each) train
``scaling_workload``'s model on their own, once free-running and once with a barrier after
each block's forward and before each block's backward (close to FSDP's rhythm), in interleaved
rounds. Nothing is exchanged but the barrier's empty message, so

    lockstep_cost = median step (in step) / median step (free-running)

is what a framework with that many synchronisation points pays on this machine before any
byte of communication, and 1 / lockstep_cost bounds such a framework's scaling efficiency
here.

Run: ``python benchmarks/lockstep.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402
import scaling_workload  # noqa: E402

MODES = ("free", "lockstep")


def _barrier_hook(*_: Any) -> None:
    dist.barrier()


def _worker(rank: int, world: int, port: int, settings: dict[str, int], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # The first block's input needs no gradient; its hook still fires, which is all the
    # barrier needs.
    warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    models = {mode: scaling_workload.ScalingMLP() for mode in MODES}
    for block in models["lockstep"].blocks:
        block.register_forward_hook(_barrier_hook)
        block.register_full_backward_pre_hook(_barrier_hook)
    optimizers = {mode: torch.optim.AdamW(model.parameters(), fused=True)
                  for mode, model in models.items()}
    inputs = torch.randn(settings["batch"], scaling_workload.FEATURES)
    target = torch.randint(0, scaling_workload.CLASSES, (settings["batch"],))

    def step(mode: str) -> None:
        loss = torch.nn.functional.cross_entropy(models[mode](inputs), target)
        loss.backward()
        optimizers[mode].step()
        optimizers[mode].zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:
        step(mode)  # warm-up
    for _ in range(settings["rounds"]):
        for mode in MODES:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(settings["steps"]):
                step(mode)
            dist.barrier()
            times[mode].append((time.perf_counter() - start) / settings["steps"])
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def measure(processes: int, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    """Per-round step times of both modes, their medians and the lock-step cost."""
    from gpuflow.parallel.env import free_port

    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "times.json")
        settings = {"batch": batch, "steps": steps, "rounds": rounds}
        mp.spawn(_worker, args=(processes, free_port(), settings, out), nprocs=processes)
        times = json.loads(Path(out).read_text())
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    per_round = [step / free for step, free in zip(times["lockstep"], times["free"],
                                                    strict=True)]
    table = [f"{'mode':<14}{'median ms':>10}  per round (ms)",
             *(f"{mode:<14}{1e3 * medians[mode]:>10.1f}  "
               + " ".join(f"{1e3 * t:.0f}" for t in times[mode]) for mode in MODES),
             f"{'cost':<14}{medians['lockstep'] / medians['free']:>10.3f}  "
             + " ".join(f"{c:.2f}" for c in per_round)]
    return {"step_s_per_round": times, "median_step_s": medians,
            "lockstep_cost": medians["lockstep"] / medians["free"],
            "efficiency_bound": medians["free"] / medians["lockstep"], "table": table}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2048,
                        help="per process (default 2048, as benchmarks/scaling.py)")
    parser.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.monotonic()
    result = measure(args.processes, args.batch_size, args.steps, args.rounds)
    payload = {
        "benchmark": "lockstep",
        **_common.provenance(),
        "machine": _common.machine_info(),
        "settings": {"processes": args.processes, "batch_size": args.batch_size,
                     "steps": args.steps, "rounds": args.rounds, "torch_threads": 1},
        "wall_s": time.monotonic() - started,
        **result,
    }
    out = args.out or _common.default_result_path("lockstep")
    _common.write_json(out, payload)
    medians = result["median_step_s"]
    print(f"free-running {1e3 * medians['free']:.1f} ms, in step {1e3 * medians['lockstep']:.1f} "
          f"ms per step: lock-step cost {result['lockstep_cost']:.3f}, so a framework that "
          f"synchronises every block reaches at most {result['efficiency_bound']:.3f} of the "
          f"free-running throughput here; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
