"""How far `gpuflow serve --max-autotune`'s decode logits stray from the eager step's.

docs/serving.md states the bound; this measures it. For each model, one eager runner and
one compiled with inductor's ``max-autotune`` (on the CPU over weights frozen while
compiling, as the server warms it up) decode the same sequence in lockstep, one row at a
time: each step both get the eager step's greedy token, so they see the same context, and
the step's logits are compared. Reported per model: the largest absolute logit difference,
the largest logit (its scale), and in how many steps the greedy tokens agreed.

    .venv/bin/python benchmarks/autotune_equality.py   # ~1 minute on 2 cores (two compiles)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402

from gpuflow.models.gpt import GPT  # noqa: E402
from gpuflow.serve.generate.models import paged_lm  # noqa: E402
from gpuflow.serve.generate.paged import PagedLM, RowSpec  # noqa: E402
from gpuflow.serve.generate.runner import ModelRunner  # noqa: E402
from gpuflow.workloads.textlm import parse_model_size  # noqa: E402

BLOCK_SIZE = 16


def textlm_tiny() -> torch.nn.Module:
    """textlm tiny (4 layers x 128, byte vocabulary), the model docs/serving.md times."""
    return GPT(parse_model_size("tiny")).eval()


def llama_tiny() -> torch.nn.Module:
    """A 2-layer Llama config (width 64, grouped-query attention), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


MODELS: dict[str, tuple[str, Callable[[], torch.nn.Module]]] = {
    "textlm-tiny": ("textlm tiny (4 x 128, 128 context)", textlm_tiny),
    "llama-tiny": ("Llama config, 2 x 64, 4 heads over 2 KV heads", llama_tiny),
}


def lockstep(lm: PagedLM, steps: int, prompt: list[int]) -> dict[str, Any]:
    """Eager and max-autotune decode of one row, ``len(prompt) + steps`` positions."""
    blocks = list(range(1, (len(prompt) + steps) // BLOCK_SIZE + 2))  # block 0: the null
    eager = ModelRunner(lm, len(blocks) + 1, BLOCK_SIZE, 1, bucketed=True)
    tuned = ModelRunner(lm, len(blocks) + 1, BLOCK_SIZE, 1, max_autotune=True)
    tuned.warm_up()
    if tuned.compile_failure is not None:
        raise SystemExit(f"max-autotune compile failed: {tuned.compile_failure}")
    worst, scale, agree, token = 0.0, 0.0, 0, prompt[0]
    for position in range(len(prompt) + steps):
        rows = [RowSpec([token], position, blocks)]
        ours, theirs = eager.run_flat(rows).float(), tuned.run_flat(rows).float()
        worst = max(worst, (ours - theirs).abs().max().item())
        scale = max(scale, ours.abs().max().item())
        generated = position >= len(prompt) - 1
        agree += int(generated and ours.argmax().item() == theirs.argmax().item())
        token = prompt[position + 1] if not generated else int(ours.argmax())
    return {"decode": tuned.describe(), "greedy_steps": steps + 1, "greedy_agree": agree,
            "max_abs_logit_diff": worst, "max_abs_logit": scale,
            "max_diff_over_largest_logit": worst / scale}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--steps", type=int, default=40, help="greedy steps after the prompt")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as docs/serving.md's decode timings
    results = {}
    for name in args.models:
        about, build = MODELS[name]
        torch.manual_seed(0)
        lm = paged_lm(build(), torch.float32, tokenized=True)
        assert lm is not None, name
        prompt = torch.randint(1, 200, (8,), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            results[name] = {"model": about, **lockstep(lm, args.steps, prompt.tolist())}
        figures = results[name]
        print(f"{name}: max |logit diff| {figures['max_abs_logit_diff']:.2e} "
              f"(largest logit {figures['max_abs_logit']:.2f}), greedy tokens agree "
              f"{figures['greedy_agree']}/{figures['greedy_steps']}")
    out = args.out or _common.default_result_path("autotune_equality")
    _common.write_json(out, {
        "benchmark": "autotune_equality",
        **_common.provenance(transformers=_common.package_version("transformers")),
        "machine": {**_common.machine_info(), "torch_threads": 1},
        "steps": args.steps,
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in results.values()),
        "greedy_disagreements": sum(r["greedy_steps"] - r["greedy_agree"]
                                    for r in results.values()),
        "results": results})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
