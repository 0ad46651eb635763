"""Speculative decoding against plain decoding, one client, side by side in one process.

A textlm GPT trained here on the Python standard library's modules (``--run DIR``
serves a run of your own instead) completes prompts greedily
through the generation engine, one request at a time, with each setting in turn, round by
round (median of the rounds), on one torch thread:

- ``plain``: one token a step;
- ``lookup-K``: prompt lookup drafts K tokens (``--num-speculative-tokens K``);
- ``draft-K``: a smaller textlm, trained the same way, drafts K tokens (``--draft-model``).

The results keep each prompt's greedy text: a model this small loops, and a loop is what
drafts predict best, so read the speed-ups beside the text they drafted.

Two prompts: ``code`` (a class whose methods repeat one another's shape: the completion
the issue's target names, >= 1.5x tokens/s with prompt lookup) and ``prose`` (sentences
of a docstring's kind, with less to copy). Every setting's text must be the plain one's,
token for token; the result says so, with each setting's acceptance rate.

    .venv/bin/python benchmarks/speculative.py              # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/speculative.py --quick      # a minute, fewer steps
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import default_result_path, machine_info, provenance, write_json  # noqa: E402

from gpuflow import TrainConfig, train  # noqa: E402
from gpuflow.models.gpt import GPT  # noqa: E402
from gpuflow.serve.generate.build import build_engine  # noqa: E402
from gpuflow.serve.generate.engine import GenerationEngine  # noqa: E402
from gpuflow.serve.generate.limits import EngineLimits  # noqa: E402
from gpuflow.serve.generate.models import GPTDecoder  # noqa: E402
from gpuflow.serve.generate.requests import Done  # noqa: E402
from gpuflow.serve.generate.sampling import SamplingParams  # noqa: E402
from gpuflow.serve.model import load_model  # noqa: E402
from gpuflow.workloads import textlm  # noqa: E402

MODEL_SIZE = "layers=4,dim=128,heads=4,seq=256"
DRAFT_SIZE = "layers=1,dim=64,heads=2,seq=256"
PROMPTS = {
    "code": """class Vector:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __add__(self, other):
        return Vector(self.x + other.x, self.y + other.y)

    def __sub__(self, other):
""",
    "prose": ("The module provides functions for working with files and directories. Each "
              "function raises an exception when the operating system reports an error, "),
}


def stdlib_corpus(folder: Path) -> Path:
    """The Python standard library's own modules, copied as ``.txt`` files (textlm reads
    text files): code for a model to complete code."""
    folder.mkdir()
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        (folder / f"{source.stem}.txt").write_bytes(source.read_bytes())
    return folder


def trained(size: str, steps: int, run_dir: Path, corpus: Path) -> GPT:
    """A textlm of ``size`` trained ``steps`` steps on ``corpus``."""
    result = train(textlm.build(data_dir=str(corpus), model_size=size),
                   TrainConfig(max_steps=steps, batch_size=16, lr=3e-3, progress=False,
                               eval_every=0, run_dir=str(run_dir), workload="textlm",
                               model_size=size, seed=0))
    return result.model.eval()


def engine(model: GPT, draft: GPT | None, tokens: int) -> GenerationEngine:
    limits = EngineLimits(max_num_seqs=1, num_speculative_tokens=tokens)
    return build_engine(GPTDecoder(model, torch.float32), 128, limits, torch.inference_mode,
                        draft=None if draft is None else GPTDecoder(draft, torch.float32))


def complete(setup: GenerationEngine, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy completion through a fresh engine: its tokens, tokens/s, acceptance."""
    async def scenario() -> tuple[list[int], float]:
        setup.start()
        try:
            await asyncio.to_thread(setup.wait_warm, 120)
            began = time.perf_counter()
            generation = setup.submit(list(prompt.encode()), SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            while not isinstance(await generation.events.get(), Done):
                pass
            return generation.generated, time.perf_counter() - began
        finally:
            setup.stop()

    tokens, seconds = asyncio.run(scenario())
    return {"tokens": tokens, "tokens_per_s": len(tokens) / seconds,
            "drafted": setup.core.drafted, "accepted": setup.core.accepted}


def measure(models: dict[str, GPT | None], settings: dict[str, tuple[str | None, int]],
            rounds: int, max_tokens: int) -> dict[str, Any]:
    """Each prompt under each setting, taking turns round by round."""
    results: dict[str, Any] = {}
    for name, prompt in PROMPTS.items():
        runs: dict[str, list[dict[str, Any]]] = {setting: [] for setting in settings}
        for _ in range(rounds):
            for setting, (draft, tokens) in settings.items():
                setup = engine(models["target"], models[draft] if draft else None, tokens)
                runs[setting].append(complete(setup, prompt, max_tokens))
        plain = runs["plain"][0]["tokens"]
        results[name] = {setting: summary(done, plain) for setting, done in runs.items()}
        base = results[name]["plain"]["tokens_per_s"]
        for row in results[name].values():
            row["speedup"] = round(row["tokens_per_s"] / base, 2)
        results[name]["text"] = bytes(plain).decode("utf-8", errors="replace")
    return results


def summary(done: list[dict[str, Any]], plain: list[int]) -> dict[str, Any]:
    drafted, accepted = done[-1]["drafted"], done[-1]["accepted"]
    return {"tokens_per_s": round(statistics.median(d["tokens_per_s"] for d in done), 1),
            "rounds": [round(d["tokens_per_s"], 1) for d in done],
            "identical_text": all(d["tokens"] == plain for d in done),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--run", type=Path, help="time this textlm run (any --model-size) instead of training one")
    add("--steps", type=int, default=1500, help="training steps of each model (default 1500)")
    add("--rounds", type=int, default=3)
    add("--max-tokens", type=int, default=80)
    add("--quick", action="store_true", help="80 training steps, one round, 32 tokens")
    add("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.max_tokens = 80, 1, 32
    return args


def main() -> int:
    args = parse()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:  # trained on every core, timed on one
        corpus = stdlib_corpus(Path(scratch) / "stdlib")
        target = (load_model(args.run).model.eval() if args.run else
                  trained(MODEL_SIZE, args.steps, Path(scratch) / "target", corpus))
        draft = trained(DRAFT_SIZE, args.steps, Path(scratch) / "draft", corpus)
    trained_s = time.perf_counter() - started
    torch.set_num_threads(1)
    settings = {"plain": (None, 0), "lookup-4": (None, 4), "lookup-8": (None, 8),
                "draft-3": ("draft", 3)}
    results = measure({"target": target, "draft": draft}, settings, args.rounds,
                      args.max_tokens)
    out = args.out or default_result_path("speculative")
    write_json(out, {
        "benchmark": "speculative", **provenance(), "machine": machine_info(),
        "model": {"target": str(args.run) if args.run else MODEL_SIZE, "draft": DRAFT_SIZE,
                  "training_steps": None if args.run else args.steps,
                  "training_s": round(trained_s, 1)},
        "max_tokens": args.max_tokens, "rounds": args.rounds, "results": results,
        "targets": {"code lookup-4 >= 1.5x tokens/s, identical text":
                    results["code"]["lookup-4"]["speedup"] >= 1.5
                    and results["code"]["lookup-4"]["identical_text"]}})
    for name in PROMPTS:
        for setting, row in results[name].items():
            if setting != "text":
                print(f"{name:6} {setting:9} {row['tokens_per_s']:8.1f} tok/s "
                      f"{row['speedup']:5.2f}x  accepted {row['acceptance_rate']}  "
                      f"identical {row['identical_text']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
