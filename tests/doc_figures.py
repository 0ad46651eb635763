"""The figures the docs quote from results files, as rows that tests/test_doc_figures.py
checks against those files (serving.md's rows: ``doc_figures_serving``).

A row: the page, the quoted text with ``{}`` where each figure stands (white space as in a
sentence: line breaks count as spaces), the results file (``name@commit`` reads the version
of a file that a later run replaced), and each figure's JSON path and format. A path is dot
separated; ``[key=value]`` picks the item of a list, ``[1:]`` slices one; ``|min``,
``|max`` and ``|abs`` reduce a list (or a mapping's values) or a number; ``*1000`` scales
(seconds to ms), ``/GiB`` and ``/MiB`` divide by 2**30 and 2**20; a string (a speaker's
name) is quoted as it is. A figure the file holds only as parts (a ratio of two of its
numbers) is a function of it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

JsonPath = str | Callable[[Any], float]
Figure = tuple[str, str, str, list[tuple[JsonPath, str]]]  # page, quote, file, figures
PERF, PLANNER = "docs/performance.md", "docs/planner.md"
IMAGES, FINETUNE = "docs/workloads/images.md", "docs/workloads/finetune.md"
ASR, BATCHING = "docs/workloads/asr.md", "figures.batching"
DATA, SCALE = "docs/data.md", "data_scale-intel-r-xeon-r-2c.json"
SPEECH, SPEAKERS = "docs/workloads/speech.md", ("george", "jackson", "nicolas", "theo", "yweweler")
FOLDS = "speech-speakers-amd-epyc-2c.json"
H200, H200_OLD = "gpu_suite-nvidia-h200.json", "gpu_suite-nvidia-h200.json@74802e9"
RERUN, SERVING = "gpu_suite-nvidia-h200-rerun.json", "gpu_suite-nvidia-h200-serving.json"
QUALITY = "lora_quality-intel-r-xeon-r-2c.json"


def _rounds(top: str, bottom: str, figure: str) -> list[tuple[JsonPath, str]]:
    """Each round's ratio of two contenders' figure (``rounds[i].<contender>.<figure>``)."""
    return [(lambda result, i=i: result["rounds"][i][top][figure]
             / result["rounds"][i][bottom][figure], ".2f") for i in (0, 1)]


def _loader(name: str) -> list[tuple[JsonPath, str]]:
    """image_loader: one set's images/s per core, the median ratio and the target."""
    base = f"sets.{name}"
    return [(f"{base}.images_per_s_per_core.gpuflow", ".1f"),
            (f"{base}.images_per_s_per_core.tutorial", ".1f"), (f"{base}.ratio_median", ".2f"),
            (f"{base}.target", ".1f")]


def _batching(scheme: str) -> list[tuple[JsonPath, str]]:
    """asr: one batching scheme's padding (epoch, timed steps), audio s/s and characters/s."""
    base = f"{BATCHING}.{scheme}"
    return [(f"{base}.epoch_padding_fraction", ".1%"), (f"{base}.step_padding_fraction", ".1%"),
            (f"{base}.audio_s_per_s", ".1f"), (f"{base}.chars_per_s", ",.0f")]


def _speaker(name: str) -> list[tuple[JsonPath, str]]:
    """asr-speakers: one held-out speaker's WERs, CER and the isolated-digit error."""
    return [(f"figures.greedy.per_speaker.{name}", ".1%"),
            (f"figures.lexicon.per_speaker.{name}", ".1%"),
            (f"runs[held_out={name}].cer_greedy", ".1%"),
            (f"figures.isolated_digit_error.{name}", ".1%")]


def _scale(run: str, size: str) -> list[tuple[JsonPath, str]]:
    """data_scale: one corpus's packing and training figures."""
    pack, train = f"runs.{run}.pack", f"runs.{run}.train"
    return [(f"runs.{run}.corpus_bytes*1e-9", size), (f"{pack}.wall_s", ".1f"),
            (f"{pack}.mb_per_s", ".0f"), (f"{pack}.peak_rss_bytes/MiB", ".0f"),
            (f"{pack}.shards.train", ".0f"), (f"{pack}.shards.val", ".0f"),
            (f"{train}.peak_rss_bytes/MiB", ".0f"), (f"{train}.data_wait_frac", ".4f"),
            (f"{train}.eval_share", ".1%")]


def _accuracy(name: str, seed: int) -> Callable[[Any], float]:
    """speech-speakers: one fold's held-out accuracy (``none``: the same-speaker run)."""
    return lambda result: next(run["accuracy"] for run in result["runs"]
                               if run["held_out"] == name and run["seed"] == seed)


def _seed(seed: int) -> list[tuple[JsonPath, str]]:
    """speech-speakers: one seed's row, each held-out speaker, their mean and the worst."""
    folds = [_accuracy(name, seed) for name in SPEAKERS]
    return [*((fold, ".1%") for fold in folds),
            (lambda result: statistics.mean(fold(result) for fold in folds), ".1%"),
            (lambda result: min(fold(result) for fold in folds), ".1%")]


def _history(label: str, what: str, file: str, bold: str = "") -> Figure:
    """One row of speech.md's history: the mean of the seeds by speaker, the mean, the worst,
    the same-speaker accuracy and the range of a leave-one-speaker-out run's wall time."""
    walls = [(lambda result, pick=pick: pick(run["command_wall_s"] for run in result["runs"]
                                             if run["held_out"] != "none"), ".0f")
             for pick in (min, max)]
    figures = [(f"figures.per_speaker.{name}", ".1%") for name in SPEAKERS]
    return (SPEECH, f"| {label} | {what} | {' | '.join(['{}'] * 5)} | {bold}{{}}{bold} | "
            f"{bold}{{}}{bold} | {{}} | {{}}-{{}} s", file,
            [*figures, ("figures.mean", ".1%"), ("figures.worst", ".1%"),
             ("figures.same_speaker", ".1%"), *walls])


def _ratio(model: str) -> list[tuple[JsonPath, str]]:
    """compare_trainers: gpuflow/plain's median and 95% interval for one model."""
    base = f"cases[model={model}].vs_plain.gpuflow.median_ratio"
    return [(base, ".3f"), (f"{base}_ci95.0", ".3f"), (f"{base}_ci95.1", ".3f")]


def _plan(label: str) -> list[tuple[JsonPath, str]]:
    """The planner's predicted and measured step (ms) and peak memory (GiB) for one train
    run, each with its error."""
    figures: list[tuple[JsonPath, str]] = []
    for key, unit in (("step_time_s", "*1000"), ("peak_mem_bytes", "/GiB")):
        base = f"train[label={label}].planner.{key}"
        figures += [(f"{base}.predicted{unit}", ".1f"), (f"{base}.measured{unit}", ".1f"),
                    (f"{base}.error", "+.0%")]
    return figures


FIGURES: list[Figure] = [
    (PERF, "measured gpuflow/plain at {} (95% interval {}-{}) on the transformer",
     "compare_trainers-amd-epyc-2c.json", _ratio("transformer")),
    (PERF, "and {} ({}-{}) on the CNN, within 1%", "compare_trainers-amd-epyc-2c.json",
     _ratio("cnn")),
    (PERF, "Fabric and Accelerate beyond that noise ({} and {})",
     "compare_trainers-amd-epyc-2c.json",
     [("cases[model=cnn].target.gpuflow_vs.fabric.median_ratio", ".3f"),
      ("cases[model=cnn].target.gpuflow_vs.accelerate.median_ratio", ".3f")]),
    (PERF, "measured gpuflow/plain at {} ({}-{}) on the transformer and {} ({}-{}) on the "
     "CNN; the same", "compare_trainers-intel-r-xeon-r-2c.json",
     _ratio("transformer") + _ratio("cnn")),
    (PERF, "gave {} ({}-{}) and {} ({}-{}), so the split",
     "compare_trainers-intel-r-xeon-r-2c-before-split.json",
     _ratio("transformer") + _ratio("cnn")),
    (PERF, "measured gpuflow/plain at {} ({}-{}) on the transformer and {} ({}-{}) on the "
     "CNN (`benchmarks/results/compare_trainers-amd-epyc-2c-after-house.json`",
     "compare_trainers-amd-epyc-2c-after-house.json",
     _ratio("transformer") + _ratio("cnn")),
    (PERF, "gave {} ({}-{}) and {} ({}-{}): no change",
     "compare_trainers-amd-epyc-2c-before-house.json",
     _ratio("transformer") + _ratio("cnn")),
    (PERF, "are {} for ddp ({} with `--bucket-mb 1`), {} for fsdp per block and {} for fsdp "
     "as one unit", "scaling-amd-epyc-2c.json",
     [(f"efficiency.{name}.median", ".3f") for name in ("ddp", "ddp-bucket1", "fsdp",
                                                         "fsdp-model")]),
    (PERF, "| textlm 124m bf16, micro-batch 64 | {} | {} |", H200,
     [("train[label=124m-bf16].tokens_per_s", ",.0f"), ("train[label=124m-bf16].mfu", ".1%")]),
    (PERF, "| textlm 1b bf16, micro-batch 16 | {} | {} |", H200,
     [("train[label=1b-bf16].tokens_per_s", ",.0f"), ("train[label=1b-bf16].mfu", ".1%")]),
    (PERF, "| textlm 1b fp8 (tensorwise) | {} ({}x bf16) | {} of the bf16 peak |", H200,
     [("train[label=1b-fp8].tokens_per_s", ",.0f"),
      ("verdicts.fp8 vs bf16 1b.tokens_per_s_ratio", ".2f"), ("train[label=1b-fp8].mfu", ".1%")]),
    (PERF, "| textlm 124m fp8 | {} ({}x bf16) | {} |", H200,
     [("train[label=124m-fp8].tokens_per_s", ",.0f"),
      ("verdicts.fp8 vs bf16 124m.tokens_per_s_ratio", ".2f"),
      ("train[label=124m-fp8].mfu", ".1%")]),
    (PERF, "`--cuda-graphs` over compiled | {}x the steps/s", H200,
     [("verdicts.cuda graphs.steps_per_s_ratio", ".2f")]),
    (PERF, "the 1b model was {} against bf16's {} ({} apart, fp8 lower; the target asks for "
     "within 2%), at 124m {} against {}.", H200,
     [("verdicts.fp8 vs bf16 1b.val_loss.fp8", ".2f"),
      ("verdicts.fp8 vs bf16 1b.val_loss.bf16", ".2f"),
      ("verdicts.fp8 vs bf16 1b.val_loss_rel_diff", ".1%"),
      ("verdicts.fp8 vs bf16 124m.val_loss.fp8", ".2f"),
      ("verdicts.fp8 vs bf16 124m.val_loss.bf16", ".2f")]),
    (PERF, "exposed {}-{} ms of communication in steps of {}-{} ms after the first ({} ms)",
     H200, [("fsdp_comm.comm_s|min*1000", ".0f"), ("fsdp_comm.comm_s|max*1000", ".0f"),
            ("fsdp_comm.step_time_s[1:]|min*1000", ".0f"),
            ("fsdp_comm.step_time_s[1:]|max*1000", ".0f"),
            ("fsdp_comm.step_time_s.0*1000", ".0f")]),
    (PERF, "measured /v1/predict at {} req/s with dynamic batching against {} at batch size 1 "
     "({} and {} with `--cuda-graphs`)", SERVING,
     [("serving.runs.dynamic.requests_per_s", ".0f"),
      ("serving.runs.max_batch_size_1.requests_per_s", ".0f"),
      ("serving_cuda_graphs.runs.dynamic.requests_per_s", ".0f"),
      ("serving_cuda_graphs.runs.max_batch_size_1.requests_per_s", ".0f")]),
    (PERF, "measured 124m at {}k tokens/s, {} MFU at micro-batch 128", RERUN,
     [("train[label=124m-b128].tokens_per_s*0.001", ".0f"),
      ("train[label=124m-b128].mfu", ".1%")]),
    (PLANNER, "| 124m | 32 | {} ms / {} ms ({}) | {} / {} GiB ({}) |", H200_OLD,
     _plan("124m-b32")),
    (PLANNER, "| 124m | 64 | {} ms / {} ms ({}) | {} / {} GiB ({}) |", RERUN,
     _plan("124m-b64")),
    (PLANNER, "| 124m | 128 | {} ms / {} ms ({}) | {} / {} GiB ({}) |", RERUN,
     _plan("124m-b128")),
    (PLANNER, "| 1b | 8 | {} ms / {} ms ({}) | {} / {} GiB ({}) |", H200_OLD,
     _plan("1b-b8")),
    (PLANNER, "| 1b | 16 | {} ms / {} ms ({}) | {} / {} GiB ({}) |", H200_OLD,
     _plan("1b-b16")),
    (PLANNER, "124m at micro-batch 64, {} / {} ms ({}) and {} / {} GiB ({}); 1b at "
     "micro-batch 16, {} / {} ms ({}) and {} / {} GiB ({}).", H200,
     _plan("124m-bf16")
     + _plan("1b-bf16")),
    (PLANNER, "calibrated the 124m efficiency to {} and then predicted its step within {}.",
     H200, [("plan.measured.efficiency", ".3f"),
            ("plan.measured.step_error_vs_train|abs", ".1%")]),
    (PLANNER, "1b fp8 steps took {} ms, 37% under the bf16 prediction, with {} GiB of the {} "
     "predicted", H200, [("train[label=1b-fp8].step_time_s*1000", ".0f"),
                         ("train[label=1b-fp8].peak_mem_bytes/GiB", ".1f"),
                         ("train[label=1b-fp8].planner.peak_mem_bytes.predicted/GiB", ".1f")]),
    (IMAGES, "| ImageNet-sized (~500x375) | {} | {} | {}x | >= {}x |",
     "image_loader-amd-epyc-2c.json", _loader("imagenet-sized")),
    (IMAGES, "| photo-sized (~2000x1500) | {} | {} | {}x | >= {}x |",
     "image_loader-amd-epyc-2c.json", _loader("photo-sized")),
    (IMAGES, "| photo-sized, re-encoded to 512 on the longer side | {} | {} | {}x | >= {}x |",
     "image_loader-amd-epyc-2c.json", _loader("photo-sized-max-side-512")),
    (FINETUNE, "({}M tokens) packed at {}x the tokens/s of `encode_batch` over the corpus held "
     "in memory, the median of two rounds ({}x and {}x; the issue's target is 0.9x; other jobs "
     "used {} of the CPUs, and `encode_batch`'s second round, holding {} GB, slowed most), "
     "with a peak of {} MiB resident over the packing process and its two workers ({} MiB in "
     "the packing process)", "pack_tokens-amd-epyc-2c.json",
     [("rounds.0.gpuflow.tokens*1e-6", ".1f"), ("ratio_tokens_per_s_median", ".2f"),
      *_rounds("gpuflow", "encode_batch", "tokens_per_s"), ("foreign_cpu_share", ".0%"),
      ("rounds.1.encode_batch.peak_rss_mb*0.001", ".1f"),
      ("rounds.0.gpuflow.peak_total_rss_mb", ".0f"), ("rounds.0.gpuflow.peak_rss_mb", ".0f")]),
    (FINETUNE, "trains at {}x and {}x the plain PyTorch loop's tokens/s in two rounds ({} vs {} "
     "tokens/s in the first); MFU {} for both in that round against the CPU peak gpuflow "
     "measures, and {} for `textlm`", "finetune-amd-epyc-2c.json",
     [*_rounds("gpuflow", "plain", "tokens_per_s"), ("rounds.0.gpuflow.tokens_per_s", ".0f"),
      ("rounds.0.plain.tokens_per_s", ".0f"), ("rounds.0.gpuflow.mfu", ".1%"),
      ("rounds.0.textlm.mfu", ".1%")]),
    (FINETUNE, "adapters on every linear layer peak at {} GiB resident against {} GiB for the "
     "full fine-tune, {}x (issue 52's target: at most 0.45x), and run at {}x and {}x its "
     "tokens/s in two rounds (target 1.2x)", "lora_memory-amd-epyc-2c.json",
     [("rounds.0.lora.peak_mem_bytes/GiB", ".2f"), ("rounds.0.full.peak_mem_bytes/GiB", ".2f"),
      ("lora_over_full_peak_memory_median", ".2f"), *_rounds("lora", "full", "tokens_per_s")]),
    (FINETUNE, "with `--quantize-base nf4` the same adapters peak at {} GiB, {}x the full "
     "fine-tune's (target: at most 0.30x), and run at {}x and {}x its tokens/s",
     "lora_memory-amd-epyc-2c.json",
     [("rounds.0.qlora.peak_mem_bytes/GiB", ".2f"), ("qlora_over_full_peak_memory_median", ".3f"),
      *_rounds("qlora", "full", "tokens_per_s")]),
    (FINETUNE, "more: LoRA {}x, QLoRA {}x.", "lora_memory-intel-r-xeon-r-2c.json",
     [("lora_over_full_peak_memory_median", ".2f"),
      ("qlora_over_full_peak_memory_median", ".3f")]),
    (FINETUNE, "| SmolLM2-135M-Instruct as converted | | | | {} |", QUALITY,
     [("figures.exact_match.base", ".1%")]),
    *((FINETUNE, f"| {label} | {{}} | {{}}M | {{}} s | {{}} |", QUALITY,
       [(f"training.{run}.lr", "g"), (f"training.{run}.trainable_params*1e-6", ".1f"),
        (f"training.{run}.train_s", ".0f"), (f"figures.exact_match.{run}", ".1%")])
      for run, label in (("lora", "LoRA rank 16, alpha 32, all linear layers"),
                         ("full", "full fine-tune"))),
    (FINETUNE, "Other jobs used {} of the CPUs meanwhile, so the seconds are loose figures.",
     QUALITY, [("foreign_cpu_share", ".0%")]),
    (ASR, "| batches ({} an epoch, {} utterances on average) |", "asr-amd-epyc-2c.json",
     [(f"{BATCHING}.batches", ".0f"), (f"{BATCHING}.mean_batch_utterances", ".1f")]),
    (ASR, "| duration buckets, 60 s budget | **{}** | {} | {} | {} |", "asr-amd-epyc-2c.json",
     _batching("duration_buckets")),
    (ASR, "| random, same mean size | {} | {} | {} | {} |", "asr-amd-epyc-2c.json",
     _batching("random")),
    (ASR, "trained **{}x** as much audio a second", "asr-amd-epyc-2c.json",
     [(f"{BATCHING}.throughput_gain", ".2f")]),
    (ASR, "the 400 held-out utterances ({} s of audio) through the transcription codec on one "
     "torch thread in batches of up to 8 grouped by padded length, fresh weights: **{}x real "
     "time** ({} s;", "asr-amd-epyc-2c.json",
     [("figures.serving.audio_s", ".0f"), ("figures.serving.inverse_real_time_factor", ".0f"),
      ("figures.serving.wall_s", ".1f")]),
    *((ASR, f"| {name} | {{}} | {{}} | {{}} | {{}} |", "asr-speakers-amd-epyc-2c.json",
       _speaker(name)) for name in ("george", "jackson", "nicolas", "theo", "yweweler")),
    (ASR, "| **mean** | **{}** | **{}** | | {} |", "asr-speakers-amd-epyc-2c.json",
     [("figures.greedy.mean", ".1%"), ("figures.lexicon.mean", ".1%"),
      (lambda result: statistics.mean(result["figures"]["isolated_digit_error"].values()),
       ".1%")]),
    (ASR, "| **worst** | {} ({}) | {} ({}) | | {} (george) |", "asr-speakers-amd-epyc-2c.json",
     [("figures.greedy.worst", ".1%"), ("figures.greedy.worst_speaker", "s"),
      ("figures.lexicon.worst", ".1%"), ("figures.lexicon.worst_speaker", "s"),
      ("figures.isolated_digit_error|max", ".1%")]),
    (DATA, "other jobs using {} of the CPUs meanwhile", SCALE, [("foreign_cpu_share", ".0%")]),
    *((DATA, "| {} GB | {} s | {} MB/s | {} MiB | {} / {} | {} MiB | {} | {} |", SCALE,
       _scale(run, size)) for run, size in (("1x", ".1f"), ("4x", ".0f"))),
    (DATA, "the same at both sizes (ratio {};", SCALE,
     [("verdicts.pack_rss_ratio_4x_to_1x", ".4f")]),
    (DATA, "Training's peak RSS grows {} for 4x the data.", SCALE,
     [(lambda result: result["verdicts"]["train_rss_ratio_4x_to_1x"] - 1, ".0%")]),
    (DATA, "(steps 100 and 200) took {} of its wall time", SCALE,
     [("runs.4x.train.eval_share", ".1%")]),
    *((SPEECH, f"| seed {seed} | {' | '.join(['{}'] * 7)} |", FOLDS, _seed(seed))
      for seed in (0, 1, 2)),
    (SPEECH, f"| **mean of the seeds** | {' | '.join(['{}'] * 5)} | **{{}}** | **{{}}** |", FOLDS,
     [*((f"figures.per_speaker.{name}", ".1%") for name in SPEAKERS), ("figures.mean", ".1%"),
      ("figures.worst", ".1%")]),
    (SPEECH, "a mean of {} (>= 90%) and a worst speaker of {} ({}, >= 85%)", FOLDS,
     [("figures.mean", ".1%"), ("figures.worst", ".1%"), ("figures.worst_speaker", "s")]),
    (SPEECH, "{} ({}, {} and {}% for seeds 0-2)", FOLDS,
     [("figures.same_speaker", ".1%"),
      *((lambda result, seed=seed: 100 * _accuracy("none", seed)(result), ".1f")
        for seed in (0, 1, 2))]),
    _history("aef2a5b", "the 2-D convolution front end", "speech-speakers-intel-r-xeon-r-2c.json"),
    _history("0893644", "waveform mixup, 25 epochs", f"{FOLDS}@0893644"),
    _history("2dba14b", "40 epochs", f"{FOLDS}@85ecb1f"),
    _history("a130cf6", "sub-spectral batch norm in the front end", f"{FOLDS}@dd0da1e"),
    _history("27d9474", "two broadcasted residual blocks", f"{FOLDS}@51265e8"),
    _history("b35dedc", "a high-pass on half the training clips (39928d8), and the weights "
             "averaged (EMA 0.99)", FOLDS, bold="**"),
]
