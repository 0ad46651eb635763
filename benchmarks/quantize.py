"""int8 weight-only serving (``gpuflow serve --quantize int8``) against fp32 and bf16.

For each way of serving one trained model: greedy decode tokens/s for one client through
the generation engine (the path of /v1/completions, without HTTP), and perplexity per byte
on held-out text (documents training never saw, the same windows in every mode, computed
by the server's runner as /v1/predict computes). Modes: fp32; bf16 autocast over fp32
weights; int8 weights with fp32 activations; int8 weights under bf16 autocast; and fp32 and
int8 with ``--compile`` (decode only: compiling changes no weight, and the predict path
would compile a graph per batch shape).

Model: textlm ``tiny`` (4 layers, d=128, 128-byte context: the shape issue 41 measured
against llama.cpp), trained ``--steps`` steps on the training split of the Python
documentation bundled with CPython; perplexity on that corpus's held-out split. Decode: a
32-byte prompt, ``--tokens`` tokens generated past any end of document (``ignore_eos``),
one request at a time, the modes taking turns round by round (median of ``--rounds``, after
a warm-up request each) once the machine is quiet; one torch thread.
Speed is the request's wall time over the tokens it generated (the prompt's prefill, one
step, included).

    .venv/bin/python benchmarks/quantize.py            # ~4 minutes on 2 cores
    .venv/bin/python benchmarks/quantize.py --quick    # ~30 s: 60 steps, 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402
    ForeignLoad,
    default_result_path,
    machine_info,
    package_version,
    provenance,
    wait_for_idle,
    write_json,
)

from gpuflow import TrainConfig, train  # noqa: E402
from gpuflow.data.text import ByteWindows, load_split  # noqa: E402
from gpuflow.serve.generate.build import build_generator  # noqa: E402
from gpuflow.serve.generate.engine import GenerationEngine  # noqa: E402
from gpuflow.serve.generate.limits import EngineLimits  # noqa: E402
from gpuflow.serve.generate.requests import Done  # noqa: E402
from gpuflow.serve.generate.sampling import SamplingParams  # noqa: E402
from gpuflow.serve.model import Runner  # noqa: E402
from gpuflow.workloads import textlm  # noqa: E402

MODEL_SIZE = "tiny"
# mode: (--precision, --quantize, --compile)
MODES: dict[str, tuple[str, str | None, bool]] = {
    "fp32": ("fp32", None, False), "bf16": ("bf16", None, False),
    "int8": ("fp32", "int8", False), "int8+bf16": ("bf16", "int8", False),
    "fp32 compiled": ("fp32", None, True), "int8 compiled": ("fp32", "int8", True)}
PROMPT = b"The Python interpreter reads a "  # 32 bytes
QUIET_SHARE = 0.1  # of the CPUs other processes may use when measuring starts


def trained_model(steps: int) -> tuple[torch.nn.Module, float]:
    """textlm ``MODEL_SIZE`` trained ``steps`` steps on pydoc's training split; seconds."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuflow-quantize-") as run_dir:
        result = train(textlm.build(model_size=MODEL_SIZE), TrainConfig(
            max_steps=steps, batch_size=16, progress=False, eval_every=0, run_dir=run_dir,
            workload="textlm", model_size=MODEL_SIZE, seed=0))
    return result.model.eval(), time.perf_counter() - start


def perplexity(runner: Runner, windows: ByteWindows, batch: int = 32) -> float:
    """exp of the mean cross-entropy per byte over every window."""
    total, count = 0.0, 0
    for start in range(0, len(windows), batch):
        xs, ys = zip(*(windows[i] for i in range(start, min(start + batch, len(windows)))),
                     strict=True)
        logits = runner(torch.stack(xs))
        target = torch.stack(ys)
        total += float(F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"))
        count += target.numel()
    return math.exp(total / count)


async def _one_request(engine: GenerationEngine, tokens: int) -> tuple[float, int]:
    """Wall seconds of one greedy request of ``tokens`` tokens, and the tokens it made."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    generation = engine.submit(list(PROMPT), params)
    while not isinstance(await generation.events.get(), Done):
        pass
    return time.perf_counter() - start, len(generation.generated)


def state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as ``torch.save`` writes them (int8 values and scales)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


class Mode:
    """One way of serving the trained model: its runner, perplexity, and engine."""

    def __init__(self, name: str, trained: torch.nn.Module, windows: ByteWindows) -> None:
        precision, quantize, compile = MODES[name]
        self.name, self.model = name, copy.deepcopy(trained)
        self.runner = Runner(self.model, "cpu", precision, compile, quantize=quantize)
        self.ppl = None if compile else perplexity(self.runner, windows)
        engine = build_generator(self.model, self.runner,
                                 EngineLimits(max_num_seqs=1, kv_cache_gib=0.05), None,
                                 eos_ids=())
        assert engine is not None
        self.engine = engine
        self.rates: list[float] = []

    def result(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "runs_on": self.runner.describe(), "decode_warmup_s": self.engine.warmup_s,
            "decode_tokens_per_s": round(statistics.median(self.rates), 1),
            "decode_tokens_per_s_rounds": [round(r, 1) for r in self.rates],
            "state_dict_bytes": state_bytes(self.model)}
        if self.ppl is not None:
            found |= {"perplexity_per_byte": round(self.ppl, 4),
                      "bits_per_byte": round(math.log2(self.ppl), 4)}
        return found


def decode_in_turns(modes: list[Mode], tokens: int, rounds: int) -> None:
    """Each mode's engine warmed and given one request, then ``rounds`` rounds of one
    request per mode in turn, so a neighbour's load falls on every mode alike."""
    async def measure() -> None:
        for mode in modes:
            mode.engine.start()
        try:
            for mode in modes:
                await asyncio.to_thread(mode.engine.wait_warm, 300)
                await _one_request(mode.engine, tokens)
            for _ in range(rounds):
                for mode in modes:
                    seconds, made = await _one_request(mode.engine, tokens)
                    mode.rates.append(made / seconds)
        finally:
            for mode in modes:
                mode.engine.stop()

    asyncio.run(measure())


def table_lines(modes: dict[str, dict[str, Any]]) -> list[str]:
    """The modes side by side; speed against fp32 compiled alike (eager or compiled)."""
    lines = [f"{'mode':<14}{'tokens/s':>10}{'vs fp32':>9}{'perplexity':>12}{'change':>9}"
             f"{'MiB':>7}"]
    for mode, found in modes.items():
        ppl, change = found.get("perplexity_per_byte"), found.get("perplexity_change_vs_fp32")
        lines.append(f"{mode:<14}{found['decode_tokens_per_s']:>10.1f}"
                     f"{found['speed_vs_fp32']:>8.2f}x"
                     f"{'-' if ppl is None else f'{ppl:.4f}':>12}"
                     f"{'-' if change is None else f'{100 * change:+.2f}%':>9}"
                     f"{found['state_dict_bytes'] / 2**20:>7.2f}")
    return lines


def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    load = ForeignLoad()
    trained, train_s = trained_model(args.steps)
    print(f"trained textlm {MODEL_SIZE} {args.steps} steps in {train_s:.0f} s", flush=True)
    held_out = load_split().val[:args.held_out_bytes]
    windows = ByteWindows(held_out, trained.config.seq_len, label="held-out pydoc text")
    wait_for_idle(args.wait_idle_s, QUIET_SHARE, log=print)
    measured = ForeignLoad()
    ways = [Mode(name, trained, windows) for name in MODES]
    decode_in_turns(ways, args.tokens, args.rounds)
    modes = {mode.name: mode.result() for mode in ways}
    for mode, found in modes.items():
        fp32 = modes["fp32 compiled" if MODES[mode][2] else "fp32"]
        found["speed_vs_fp32"] = round(
            found["decode_tokens_per_s"] / fp32["decode_tokens_per_s"], 3)
        if "perplexity_per_byte" in found:
            found["perplexity_change_vs_fp32"] = round(
                found["perplexity_per_byte"] / fp32["perplexity_per_byte"] - 1, 5)
    table = table_lines(modes)
    print("\n".join(table), flush=True)
    return {
        **provenance(torchao=package_version("torchao"),
                     transformers=package_version("transformers")),
        "machine": machine_info(),
        "benchmark": "quantize",
        "foreign_cpu_share": measured.share(),  # while decoding and computing perplexity
        "foreign_cpu_share_with_training": load.share(),
        "model": {"workload": "textlm", "model_size": MODEL_SIZE,
                  "trained_steps": args.steps, "batch_size": 16, "train_s": round(train_s, 1),
                  "corpus": "Python documentation bundled with CPython (training split)"},
        "held_out": {"bytes": len(windows) * trained.config.seq_len,
                     "windows": len(windows), "source": "the same corpus's held-out split"},
        "decode": {"prompt_bytes": len(PROMPT), "tokens": args.tokens, "rounds": args.rounds,
                   "clients": 1, "torch_threads": 1},
        "modes": modes,
        "table": table,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    parser.add_argument("--tokens", type=int, default=256,
                        help="tokens each timed request generates (default 256)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed requests per mode (default 5)")
    parser.add_argument("--held-out-bytes", type=int, default=1 << 16,
                        help="held-out text perplexity is measured on (default 65536)")
    parser.add_argument("--wait-idle-s", type=float, default=120,
                        help="wait up to this long for a quiet machine before measuring")
    parser.add_argument("--quick", action="store_true",
                        help="60 steps, 1 round, 64 tokens, 8 KiB of held-out text")
    parser.add_argument("--out", type=Path, help="result file (default: benchmarks/results/"
                        "quantize-<machine>.json; --quick writes none unless given)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.tokens, args.held_out_bytes = 60, 1, 64, 1 << 13
        args.wait_idle_s = 0
    return args


if __name__ == "__main__":
    ARGS = parse_args()
    result = main(ARGS)
    out = ARGS.out or (None if ARGS.quick else default_result_path("quantize"))
    if out is not None:
        write_json(out, result)
        print(f"wrote {out}")
