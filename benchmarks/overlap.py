"""The engine core's step time when the forward takes a fixed time and releases the GIL,
as a GPU step does, with greedy steps left in flight (the default) and without.

The core is the real one (scheduler, block manager, request bookkeeping, each step's
report pickled as the pipe to the server would carry it) over a stub runner whose forward
sleeps ``--forward-ms`` and returns fixed logits: 64 greedy rows decode for ever (no
end-of-sequence id). Measured per mode: the mean time between reports over a window of
steps. The host's own time per step is the same loop with a forward of 0 ms; the
forward's, a step's whole work in the device thread (the sleep, ~5.1 ms for 5 asked here,
and the argmax over its logits). Issue 50's
target: with overlap, the step at 64 rows takes at most 1.1x max(forward, host), where
waiting for each step made it their sum.

    .venv/bin/python benchmarks/overlap.py               # ~30 seconds
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import default_result_path, machine_info, provenance, write_json  # noqa: E402

from gpuflow.serve.generate import core as core_module  # noqa: E402
from gpuflow.serve.generate.blocks import BlockManager  # noqa: E402
from gpuflow.serve.generate.core import EngineCore  # noqa: E402
from gpuflow.serve.generate.launch import run_forward  # noqa: E402
from gpuflow.serve.generate.messages import Inbox, NewRequest  # noqa: E402
from gpuflow.serve.generate.sampling import SamplingParams  # noqa: E402
from gpuflow.serve.generate.scheduler import Scheduler  # noqa: E402

VOCAB, CONTEXT, BLOCK = 4096, 4096, 16
TARGET = 1.1


class StubRunner:
    """A model runner whose forward sleeps (the GIL released, as a GPU step's wait) and
    returns the same logits for every row."""

    graphed = False
    warmup_s = 0.0

    def __init__(self, forward_s: float) -> None:
        self.forward_s = forward_s
        self.logits = torch.zeros(1, VOCAB)
        self.logits[0, 7] = 1.0

    def warm_up(self) -> None: ...

    def run(self, rows: list[Any], patch: Any = None) -> list[torch.Tensor]:
        return list(self.run_flat(rows, patch).split(1))

    def run_flat(self, rows: list[Any], patch: Any = None) -> torch.Tensor:
        time.sleep(self.forward_s)
        return self.logits.expand(len(rows), VOCAB)


def timed_forwards(spent: list[float]) -> Any:
    """``launch.run_forward`` timed whole: a step's work in the device thread (the sleep,
    the argmax, reading the tokens the step before left there)."""
    def timed(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return run_forward(*args)
        finally:
            spent.append(time.perf_counter() - started)

    return timed


def step_ms(rows: int, forward_ms: float, overlap: bool, steps: int) -> tuple[float, float]:
    """The mean milliseconds between the core's reports over ``steps`` decode steps of
    ``rows`` greedy rows, and the mean milliseconds of a step's work in the device
    thread."""
    blocks = BlockManager(rows * CONTEXT // BLOCK + 1, BLOCK, True)
    spent: list[float] = []
    core_module.run_forward = timed_forwards(spent)
    core = EngineCore(Scheduler(blocks, rows, 2048), StubRunner(forward_ms / 1000),  # type: ignore[arg-type]
                      CONTEXT, overlap=overlap)
    params = SamplingParams(max_tokens=CONTEXT - 64, temperature=0.0)
    core.receive(Inbox(tuple(NewRequest(i, [1 + i % 50] * 16, params) for i in range(rows))))
    for _ in range(10):  # admission and the first steps
        core.step()
    times = []
    for _ in range(steps):
        report = core.step()
        pickle.dumps(report)  # what the pipe to the server carries
        times.append(time.perf_counter())
    core.stop()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return 1000 * statistics.mean(gaps), 1000 * statistics.mean(spent[10:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--forward-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = []
    for _ in range(args.rounds):
        host, _ = step_ms(args.rows, 0.0, False, args.steps)
        overlapped, slept = step_ms(args.rows, args.forward_ms, True, args.steps)
        waited, _ = step_ms(args.rows, args.forward_ms, False, args.steps)
        rounds.append({"host_ms": host, "forward_ms": slept, "overlapped_ms": overlapped,
                       "waited_ms": waited})
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    bound = max(median["forward_ms"], median["host_ms"])
    ratio = median["overlapped_ms"] / bound
    payload = {**provenance(), "machine": machine_info(), "rows": args.rows,
               "asked_forward_ms": args.forward_ms, "steps": args.steps, "rounds": rounds,
               "median": median, "overlapped_over_max_forward_host": ratio,
               "waited_over_max_forward_host": median["waited_ms"] / bound,
               "target": {"at_most": TARGET, "met": ratio <= TARGET}}
    out = args.out or default_result_path("overlap")
    write_json(out, payload)
    print(f"{args.rows} rows, forward {median['forward_ms']:.2f} ms (asked {args.forward_ms}): "
          f"host {median['host_ms']:.2f} ms a "
          f"step; left in flight {median['overlapped_ms']:.2f} ms ({ratio:.2f}x max(forward, "
          f"host)); waited for {median['waited_ms']:.2f} ms "
          f"({median['waited_ms'] / bound:.2f}x)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
