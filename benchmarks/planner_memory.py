"""The planner's predicted peak memory against the measured peak, case by case, on this CPU.

Measured peak: torch's ``MemTracker`` around two real training steps (forward, backward,
AdamW step), the method of tests/test_planner_memory.py (``planner_layouts.measured_peak``);
predicted peak: ``predict_memory`` over the workload's traced profile. Memory does not
depend on the machine's load, so a busy machine changes nothing here.

Cases: every built-in workload in one process (fp32 and bf16 autocast, textlm also with
activation checkpointing), and on 2 gloo ranks textlm 2x64 under ddp, fsdp (per block,
without resharding, as one unit, with bf16 parameters), tp and a 2-stage pipeline, the
other workloads under ddp, fsdp and (same-shaped batches only) the pipeline. Micro-batches
are per data-parallel rank. A pipeline's stages differ and the planner predicts the most
loaded one; every error is against the most loaded rank.

Run: ``python benchmarks/planner_memory.py`` (about a minute on 2 cores); ``--cases`` picks
cases by name (see ``--list``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))  # planner_layouts: the tests' measurement

import _common  # noqa: E402
from planner_layouts import SMALL_GPT, measured_peak, workload_of  # noqa: E402

from gpuflow.parallel.env import free_port  # noqa: E402
from gpuflow.planner.layout import Layout  # noqa: E402
from gpuflow.planner.memory import predict_memory  # noqa: E402
from gpuflow.planner.workload_profile import profile_workload  # noqa: E402

MIB = 2**20


@dataclass(frozen=True)
class Case:
    workload: str
    size: str | None
    layout: Layout

    @property
    def ranks(self) -> int:
        return self.layout.dp * self.layout.tp * self.layout.pp


def _single(workload: str, size: str | None, precision: str, micro_batch: int,
            checkpointing: bool = False) -> Case:
    return Case(workload, size, Layout(strategy="single", precision=precision,
                                       micro_batch=micro_batch,
                                       activation_checkpointing=checkpointing))


def _cases() -> dict[str, Case]:
    single = {
        f"{name}/{precision}/b{batch}": _single(workload, size, precision, batch)
        for name, workload, size, runs in [
            ("digits", "digits", None, [("fp32", 64), ("bf16", 64)]),
            ("mnist-idx", "mnist-idx", None, [("fp32", 32), ("fp32", 64), ("bf16", 32)]),
            ("textlm-2x64", "textlm", SMALL_GPT, [("fp32", 8), ("bf16", 8)]),
            ("speech-small", "speech", "small", [("fp32", 16), ("bf16", 16)]),
            ("speech-tiny", "speech", "tiny", [("fp32", 8), ("bf16", 8)])]
        for precision, batch in runs}
    single |= {f"textlm-2x64/{precision}/b8/checkpointing":
               _single("textlm", SMALL_GPT, precision, 8, checkpointing=True)
               for precision in ("fp32", "bf16")}
    dp = {"strategy": "fsdp", "dp": 2}
    textlm = {
        "ddp/fp32/b4": Layout(strategy="ddp", dp=2, micro_batch=4),
        "fsdp/fp32/b4": Layout(**dp, micro_batch=4),
        "fsdp-no-reshard/fp32/b4": Layout(**dp, reshard_after_forward=False, micro_batch=4),
        "tp/fp32/b4": Layout(strategy="tp", tp=2, micro_batch=4),
        "pp/fp32/b8": Layout(strategy="pp", pp=2, micro_batch=8),
        **{f"fsdp-model/{precision}/b{batch}": Layout(
            **dp, reshard_after_forward=False, fsdp_wrap="model", precision=precision,
            micro_batch=batch) for precision, batch in [("fp32", 4), ("fp32", 8), ("bf16", 8)]},
        **{f"fsdp{suffix}/bf16/b{batch}": Layout(
            **dp, reshard_after_forward=not suffix, precision="bf16", micro_batch=batch)
           for suffix, batch in [("", 4), ("", 8), ("-no-reshard", 8)]},
    }
    two = {f"2rank/textlm-2x64/{key}": Case("textlm", SMALL_GPT, layout)
           for key, layout in textlm.items()}
    # the other workloads at their single-process micro-batches; a pipeline needs batches
    # of one shape, which speech's are not
    for name, workload, size, batch in [("digits", "digits", None, 64),
                                        ("mnist-idx", "mnist-idx", None, 32),
                                        ("speech-tiny", "speech", "tiny", 8)]:
        layouts = {"ddp/fp32": Layout(strategy="ddp", dp=2, micro_batch=batch),
                   "fsdp/fp32": Layout(**dp, micro_batch=batch)}
        if workload != "speech":
            layouts["pp/fp32"] = Layout(strategy="pp", pp=2, micro_batch=batch)
        if workload != "mnist-idx":
            layouts["fsdp/bf16"] = Layout(**dp, precision="bf16", micro_batch=batch)
        two |= {f"2rank/{name}/{key}/b{batch}": Case(workload, size, layout)
                for key, layout in layouts.items()}
    two["2rank/digits/fsdp-model/fp32/b32"] = Case(
        "digits", None, Layout(**dp, reshard_after_forward=False, fsdp_wrap="model",
                               micro_batch=32))
    return {**{f"1rank/{key}": case for key, case in single.items()}, **two}


CASES = _cases()


def _peak(name: str) -> int:
    case = CASES[name]
    return measured_peak(workload_of(case.workload, case.size), case.layout)


def _two_rank_worker(rank: int, port: int, out: str, names: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peaks = {name: _peak(name) for name in names}
    Path(f"{out}.{rank}").write_text(json.dumps(peaks))
    dist.destroy_process_group()


def measure(names: list[str]) -> dict[str, list[int]]:
    """Each case's measured peak bytes, one per rank: one-process cases here, the 2-rank
    ones in one pair of gloo processes."""
    peaks = {name: [_peak(name)] for name in names if CASES[name].ranks == 1}
    two = [name for name in names if CASES[name].ranks == 2]
    if two:
        with tempfile.TemporaryDirectory() as folder:
            out = str(Path(folder) / "peaks")
            mp.spawn(_two_rank_worker, args=(free_port(), out, two), nprocs=2)
            ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
        peaks |= {name: [measured[name] for measured in ranks] for name in two}
    return peaks


def predict(names: list[str]) -> dict[str, int]:
    profiles, predicted = {}, {}
    for name in names:
        case = CASES[name]
        key = (case.workload, case.size, case.layout.precision)
        if key not in profiles:
            profiles[key] = profile_workload(workload_of(case.workload, case.size),
                                             case.layout.precision)
        predicted[name] = predict_memory(profiles[key], case.layout).peak
    return predicted


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| case | predicted | measured (most loaded rank) | error |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['case']} | {row['predicted_bytes'] / MIB:.2f} MiB | "
                     f"{row['measured_bytes'] / MIB:.2f} MiB | {100 * row['error']:+.1f}% |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=None,
                        help="case names, or prefixes of them (e.g. 1rank/ or 2rank/textlm)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    everything = list(CASES)
    if args.list:
        print("\n".join(everything))
        return 0
    names = everything if args.cases is None else [
        name for name in everything if any(name.startswith(p) for p in args.cases)]
    if not names:
        parser.error(f"no case matches {args.cases}; see --list")
    started = time.monotonic()
    measured, predicted = measure(names), predict(names)
    rows = [{"case": name, "workload": CASES[name].workload, "model_size": CASES[name].size,
             "layout": asdict(CASES[name].layout),
             "predicted_bytes": predicted[name], "measured_bytes_per_rank": measured[name],
             "measured_bytes": max(measured[name]),
             "error": predicted[name] / max(measured[name]) - 1} for name in names]
    payload = {"benchmark": "planner_memory", **_common.provenance(),
               "machine": _common.machine_info(),
               "method": "MemTracker peak of two training steps (AdamW), most loaded rank; "
                         "error = predicted / measured - 1",
               "partial": args.cases is not None, "selection": args.cases,
               "wall_s": time.monotonic() - started, "cases": rows, "table": table(rows),
               "max_abs_error": max(abs(row["error"]) for row in rows)}
    out = args.out or _common.default_result_path("planner_memory")
    _common.write_json(out, payload)
    print("\n".join(payload["table"]))
    print(f"largest error {100 * payload['max_abs_error']:.1f}%; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
