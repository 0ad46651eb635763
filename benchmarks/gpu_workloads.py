"""The GPU's workload stages: fine-tuning a ~1B Llama config, and connected-digit ASR.

Two stages that sit outside ``gpu_suite.py`` (whose one call must stay under 8 minutes),
each a ``gpuflow train`` run under its own time limit:

- ``finetune``: a Hub-style Llama directory built from a config alone (no weights: the run
  takes ``--from-config``), about 1B parameters (hidden 2048, 22 layers, 16 heads over 8
  key/value heads, MLP 5632, a 4,096-token context, the test suite's Llama-3-style BPE
  tokenizer), trained by ``--workload hf:DIR`` on the Python help topics in bf16 with
  ``--strategy fsdp --compile`` at 2,048 tokens per sequence. Recorded: tokens/s, MFU,
  step time, peak memory, the first and last steps' losses. It passes if the run finishes
  and states its MFU (no target is set).
- ``asr``: the connected-digit set (``scripts/connected_digits.py`` from the FSDD recordings
  in ``../shared/data/fsdd/recordings`` beside the repository, or ``--recordings``),
  ``--workload asr`` in bf16 with its duration buckets, eager (``--compile`` now compiles
  each block three times, for the first frame count, then dynamic frames, then a dynamic
  batch, but has not run on a GPU yet). Recorded: samples/s, audio
  seconds/s (samples/s times the set's mean utterance length), padding fraction, MFU, peak
  memory and the final validation WER/CER.

The results file is rewritten after each stage, so a cut-off run keeps what it measured; a
stage that fails records its error's tail and the next stage still runs.

Run on the GPU machine after the suite: ``python benchmarks/gpu_workloads.py [--stages
finetune,asr]`` (needs transformers for ``finetune``); ``--dry-run`` runs the same code at
toy sizes on a CPU (fine-tuning in bf16 with ``--strategy fsdp`` in one process but no
``--compile``; ASR in fp32).
Writes ``benchmarks/results/gpu_workloads-<machine>.json`` (a dry run: under a temporary
folder unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT / "tests"))  # hub_models: the Llama-3-style tokenizer
import _common  # noqa: E402
from gpu_suite import Suite, chosen_stages, failure, gpu_machine, gpuflow  # noqa: E402

STAGES = ("finetune", "asr")
RECORDINGS = ROOT.parent / "shared" / "data" / "fsdd" / "recordings"
FULL: dict[str, dict[str, Any]] = {
    "finetune": {"hidden": 2048, "layers": 22, "heads": 16, "kv_heads": 8,
                 "intermediate": 5632, "context": 4096, "seq_len": 2048, "batch": 8,
                 "steps": 40, "flags": ["--device", "cuda", "--precision", "bf16",
                                        "--strategy", "fsdp", "--compile"],
                 "limit_s": 540},
    "asr": {"per_speaker": 400, "model": "base", "steps": 600, "eval_every": 200,
            "flags": ["--device", "cuda", "--precision", "bf16"],
            "limit_s": 480},
}
DRY: dict[str, dict[str, Any]] = {
    "finetune": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 176,
                 "context": 128, "seq_len": 64, "batch": 4, "steps": 4,
                 "flags": ["--device", "cpu", "--precision", "bf16", "--strategy", "fsdp"],
                 "limit_s": 120},
    "asr": {"per_speaker": 6, "model": "tiny", "steps": 4, "eval_every": 0,
            "batch_seconds": 8, "flags": ["--device", "cpu", "--precision", "fp32"],
            "limit_s": 120},
}


def llama_directory(out: Path, settings: dict[str, Any]) -> Path:
    """config.json and the tokenizer, no weights: ``--from-config`` draws them."""
    from hub_models import build_tokenizer, save_tokenizer
    from transformers import LlamaConfig

    tokenizer = build_tokenizer("llama3")
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=settings["hidden"],
                num_hidden_layers=settings["layers"],
                num_attention_heads=settings["heads"],
                num_key_value_heads=settings["kv_heads"],
                intermediate_size=settings["intermediate"],
                max_position_embeddings=settings["context"],
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id).save_pretrained(out)
    save_tokenizer("llama3", out)
    return out


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, filter(None, lines)) if "loss" in record]


def figures(run_dir: Path) -> dict[str, Any]:
    """What both stages record from a finished run's summary.json."""
    summary = json.loads((run_dir / "summary.json").read_text())
    median = summary["median"]
    return {"ok": True, "mfu": median.get("mfu"), "samples_per_s": median.get("samples_per_s"),
            "tokens_per_s": median.get("tokens_per_s"),
            "step_time_s": median.get("step_time_s"),
            "data_wait_frac": median.get("data_wait_frac"),
            "peak_mem_bytes": summary["peak_mem_bytes"],
            "peak_mem_kind": summary["peak_mem_kind"],
            "peak_flops": summary["peak_flops"],
            "peak_flops_source": summary["peak_flops_source"],
            "trainable_params": summary["trainable_params"],
            "precision": summary["precision"], "strategy": summary["strategy"],
            "compiled": summary["compiled"], "compile_scope": summary["compile_scope"],
            "steps": summary["steps"], "global_batch": summary["global_batch"],
            "wall_time_s": summary["wall_time_s"], "device_name": summary["device_name"],
            "final_metrics": summary["final_metrics"]}


def train(suite: Suite, name: str, limit_s: float, run_dir: Path,
          *args: str) -> dict[str, Any]:
    """One ``gpuflow train`` run to the end: its summary's figures, or why it stopped."""
    suite.log(f"{name}: gpuflow train {' '.join(args[:2])}")
    code, log = suite.run(name, gpuflow(
        "train", *args, "--no-checkpoints", "--no-progress", "--run-dir", str(run_dir)),
        limit_s)
    if code == 0 and (run_dir / "summary.json").is_file():
        return figures(run_dir)
    return {"ok": False, **failure(code, log), "logged_steps": logged_steps(run_dir)}


def logged_steps(run_dir: Path) -> dict[str, Any] | None:
    """Medians over the steps a cut-off run did log, so a stage stopped by its limit still
    says how fast it went (None where it logged no step)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    if lines and not lines[-1].endswith("}"):
        lines.pop()  # the line the run was writing when it was stopped
    records = [record for record in map(json.loads, filter(None, lines)) if "loss" in record]
    if not records:
        return None
    medians = {key: statistics.median(values) for key in
               ("step_time_s", "tokens_per_s", "samples_per_s", "mfu")
               if (values := [r[key] for r in records if r.get(key) is not None])}
    return {"steps": records[-1].get("step"), "first_loss": records[0]["loss"],
            "last_loss": records[-1]["loss"], **medians}


def finetune_stage(suite: Suite, settings: dict[str, Any]) -> dict[str, Any]:
    directory = llama_directory(suite.work / "llama", settings)
    run_dir = suite.work / "finetune"
    entry = {"model": {key: settings[key] for key in
                       ("hidden", "layers", "heads", "kv_heads", "intermediate", "context")},
             **train(suite, "finetune", settings["limit_s"], run_dir,
                     "--workload", f"hf:{directory}", "--from-config",
                     "--seq-len", str(settings["seq_len"]),
                     "--batch-size", str(settings["batch"]),
                     "--max-steps", str(settings["steps"]), "--log-every", "1",
                     "--eval-every", "0", *settings["flags"])}
    if entry["ok"]:
        losses = [record["loss"] for record in metrics(run_dir)]
        entry.update(first_step_loss=losses[0], last_step_loss=losses[-1],
                     passed=entry["mfu"] is not None)
    return entry


def asr_stage(suite: Suite, settings: dict[str, Any], recordings: Path) -> dict[str, Any]:
    if not recordings.is_dir():
        return {"ok": False, "error": f"no FSDD recordings at {recordings}: the connected-digit "
                                      "set cannot be built"}
    data = suite.work / "digits"
    code, log = suite.run("connected-digits", [
        sys.executable, str(ROOT / "scripts" / "connected_digits.py"),
        "--recordings", str(recordings), "--out", str(data),
        "--per-speaker", str(settings["per_speaker"])], 120)
    if code != 0:
        return {"ok": False, "stage_step": "connected_digits.py", **failure(code, log)}
    durations = [json.loads(line)["duration"]
                 for line in (data / "manifest.jsonl").read_text().splitlines() if line]
    mean_s = sum(durations) / len(durations)
    run_dir = suite.work / "asr"
    batching = (["--batch-seconds", str(settings["batch_seconds"])]
                if "batch_seconds" in settings else [])
    entry = train(suite, "asr", settings["limit_s"], run_dir, "--workload", "asr",
                  "--data-dir", str(data), "--model-size", settings["model"], *batching,
                  "--max-steps", str(settings["steps"]),
                  "--eval-every", str(settings["eval_every"]), *settings["flags"])
    entry["data"] = {"utterances": len(durations), "mean_utterance_s": mean_s,
                     "per_speaker": settings["per_speaker"]}
    if entry["ok"]:
        paddings = [r["padding_frac"] for r in metrics(run_dir) if r.get("padding_frac")
                    is not None]
        final = entry["final_metrics"]
        entry.update(audio_s_per_s=entry["samples_per_s"] * mean_s,
                     padding_frac=sum(paddings) / len(paddings) if paddings else None,
                     val_wer=final.get("val_wer"), val_cer=final.get("val_cer"))
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes, on the CPU")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated subset of {','.join(STAGES)} (default: both)")
    parser.add_argument("--recordings", type=Path, default=RECORDINGS,
                        help=f"the FSDD recordings folder (default {RECORDINGS})")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--limit-s", type=float, default=None,
                        help="cap each stage's time limit (seconds), to fit a device lease")
    args = parser.parse_args()
    stages = chosen_stages(parser, args.stages, STAGES)
    settings = DRY if args.dry_run else FULL
    if args.limit_s:
        settings = {stage: {**values, "limit_s": min(values["limit_s"], args.limit_s)}
                    for stage, values in settings.items()}
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="gpuflow-workloads-") as tmp:
        work = Path(tmp)
        os.environ.setdefault("GPUFLOW_CACHE_DIR", str(work / "cache"))
        out = args.out or (work / "gpu_workloads.json" if args.dry_run
                           else _common.default_result_path("gpu_workloads"))
        budget = sum(settings[stage]["limit_s"] for stage in stages) + 180
        suite = Suite(args.dry_run, out, work, budget)
        suite.result = {"benchmark": "gpu_workloads", **_common.provenance(),
                        "dry_run": args.dry_run, "stages": stages,
                        "machine": {**_common.machine_info(), **gpu_machine()},
                        "settings": {stage: settings[stage] for stage in stages}}
        suite.save()
        for stage in stages:
            try:
                suite.result[stage] = (
                    finetune_stage(suite, settings[stage]) if stage == "finetune"
                    else asr_stage(suite, settings[stage], args.recordings.resolve()))
            except Exception as error:  # a stage's own set-up failing ends that stage only
                suite.result[stage] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            suite.save()
            print(f"{stage}: {json.dumps(suite.result[stage], default=str)[:600]}")
        print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
