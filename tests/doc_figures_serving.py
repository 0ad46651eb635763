"""serving.md's rows of the figure table (``doc_figures`` says what a row holds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from doc_figures import H200, SERVING, Figure, JsonPath

SERVE_DOC, GRAPHS_RUN = "docs/serving.md", "gpu_suite-nvidia-h200-generation.json"
COMPILED = "generation-textlm-compile-amd-epyc-2c.json"
QUANTIZE = "quantize-amd-epyc-2c.json"
EAGER = "generation-amd-epyc-2c.json"
HUB_LLAMA = "generation-hub-llama-amd-epyc-2c.json"
LAYOUT, CEILING = "linear_layout-intel-r-xeon-r-2c.json", "host_ceiling-intel-r-xeon-r-2c.json"
SMOLLM2 = "generation-smollm2-intel-r-xeon-r-2c.json"
STRUCTURED, STRUCTURED_DOC = "structured_output-intel-r-xeon-r-2c.json", "docs/structured-output.md"
AUTOTUNE = "autotune_equality-intel-r-xeon-r-2c.json"
LORA = "lora_serving-intel-r-xeon-r-2c.json"
LEVELS = ("1", "8", "32", "64")


def _launches(model: str, step: str) -> list[tuple[JsonPath, str]]:
    """launches: operators per layer of one step, not views and all, now and at the baseline."""
    base = f"results.{model}"
    return [(f"{base}.{who}.steps.{step}.{figure}_per_layer", ".1f")
            for figure in ("not_views", "ops") for who in ("gpuflow", "baseline")]


def _traffic(rows: int) -> list[tuple[JsonPath, str]]:
    """attention_traffic: KV positions read over those held, FlexAttention's and the padded
    path's at 8k, 32k and 128k contexts (16-token blocks, no sliding window)."""
    def batch(result: Any, context: int) -> dict[str, Any]:
        return next(b for b in result["batches"] if b["rows"] == rows and b["block_size"] == 16
                    and b["sliding_window"] is None and b["context"] == context)

    return [(lambda result: batch(result, 8192)["flex_over_held"], "g"),
            *((lambda result, context=context: batch(result, context)["padded_over_held"], "g")
              for context in (8192, 32768, 131072))]


def _hub_llama(route: str, level: str) -> Figure:
    """generation on the hub Llama: one route and level, gpuflow against transformers serve
    (at 32 clients, its errors: it answered none)."""
    engine = " tok/s; TTFT {} / {} ms; ITL {} / {} ms"
    ours, theirs = f"gpuflow {route}", f"transformers serve {route}"
    if level == "32":
        return (SERVE_DOC, f"| {route}, 32 | {{}}{engine} | none answered ({{}} errors) | |",
                HUB_LLAMA, [*_engine(ours, level), (f"runs.{theirs}.32.errors", ".0f")])
    return (SERVE_DOC, f"| {route}, {level} | {{}}{engine} | {{}}{engine} | {{}}x |", HUB_LLAMA,
            [*_engine(ours, level), *_engine(theirs, level),
             (lambda result: result["runs"][ours][level]["tokens_per_s"]
              / result["runs"][theirs][level]["tokens_per_s"], ".2f")])


def _autotune(model: str) -> list[tuple[JsonPath, str]]:
    """autotune_equality: one model's largest logit difference (in units of 1e-7), and the
    greedy steps whose tokens agreed, of all."""
    base = f"results.{model}"
    return [(lambda result: result["results"][model]["max_abs_logit_diff"] * 1e7, ".1f"),
            (f"{base}.greedy_agree", ".0f"), (f"{base}.greedy_steps", ".0f")]


def _speculative(prompt: str) -> list[tuple[JsonPath, str]]:
    """speculative: one prompt's plain tokens/s, then each drafting setting's tokens/s,
    speed-up and acceptance."""
    base = f"results.{prompt}"
    return [(f"{base}.plain.tokens_per_s", ",.0f"),
            *((f"{base}.{setting}.{figure}", spec)
              for setting in ("lookup-4", "lookup-8", "draft-3")
              for figure, spec in (("tokens_per_s", ",.0f"), ("speedup", ".2f"),
                                   ("acceptance_rate", ".0%")))]


def _against_llama_cpp(level: str) -> list[tuple[JsonPath, str]]:
    """generation: gpuflow's and llama.cpp's median tokens/s at one level, and their ratio."""
    def tokens(result: Any, contender: str) -> float:
        return result["runs"][contender][level]["tokens_per_s"]

    return [(lambda result: tokens(result, "gpuflow"), ",.0f"),
            (lambda result: tokens(result, "llama.cpp"), ",.0f"),
            (lambda result: tokens(result, "gpuflow") / tokens(result, "llama.cpp"), ".2f")]


def _batching_run(run: str, p50: str, p99: str) -> list[tuple[JsonPath, str]]:
    """serving: one configuration's requests/s, p50 and p99 latency (ms, in these formats)."""
    return [(f"runs.{run}.requests_per_s", ".0f"), (f"runs.{run}.p50_ms", p50),
            (f"runs.{run}.p99_ms", p99)]


def _contender(server: str) -> list[tuple[JsonPath, str]]:
    """serving --contenders: one server's req/s and p50 ms at 1, 8, 32 and 64 clients."""
    return [figure for level in ("1", "8", "32", "64")
            for figure in ((f"runs.{level}.{server}.requests_per_s", ",.0f"),
                           (f"runs.{level}.{server}.p50_ms", ".2f"))]


def _mode(mode: str, perplexity: bool) -> list[tuple[JsonPath, str]]:
    """quantize: one mode's decode tokens/s, speed against fp32, (perplexity per byte and its
    change,) and its weights' size."""
    base = f"modes.{mode}"
    quality = [(f"{base}.perplexity_per_byte", ".4f")]
    if mode != "fp32":
        quality.append((f"{base}.perplexity_change_vs_fp32", "+.2%"))
    return [(f"{base}.decode_tokens_per_s", ",.0f"), (f"{base}.speed_vs_fp32", ".2f"),
            *(quality if perplexity else []), (f"{base}.state_dict_bytes/MiB", ".2f")]


def _target(name: str, figure: str) -> Callable[[Any], float]:
    """kv_paging: a figure of one target (their names hold '/', which paths cannot)."""
    return lambda result: result["targets"][name][figure]


def _kv_paging(file: str, whole_p99: str, capacity: str) -> list[Figure]:
    """kv_paging's three scenarios, on against off, each with its target's ratio."""
    prefix, chunked = "results.prefix", "results.chunked"
    streams = {name: f"{chunked}.{name}.median.streams" for name in ("chunked", "whole prompts")}
    return [
        (SERVE_DOC, "| 32 clients sharing a 1,000-token system prompt: TTFT p50 | {} ms (prefix "
         "caching) | {} ms (`--no-prefix-cache`) | >= 5x lower: {}x |", file,
         [(f"{prefix}.prefix cache.median.ttft_p50_ms", ".0f"),
          (f"{prefix}.no prefix cache.median.ttft_p50_ms", ".0f"),
          (_target("prefix: TTFT p50 without / with", "ratio"), ".1f")]),
        (SERVE_DOC, "ITL p50 / p99 / longest gap | {} / {} / {} ms (`--max-num-batched-tokens "
         "64`) | {} / {} / {} ms (4096: whole prompts) | p99 <= 3x p50: {}x |", file,
         [(f"{streams['chunked']}.itl_p50_ms", ".1f"), (f"{streams['chunked']}.itl_p99_ms", ".1f"),
          (f"{streams['chunked']}.itl_max_ms", ".0f"),
          (f"{streams['whole prompts']}.itl_p50_ms", ".1f"),
          (f"{streams['whole prompts']}.itl_p99_ms", whole_p99),
          (f"{streams['whole prompts']}.itl_max_ms", ".0f"),
          (_target("chunked: streams' ITL p99 / p50, chunked", "ratio"), ".2f")]),
        (SERVE_DOC, f"| 64 clients, 64 + 64 tokens each{capacity}: sequences running at once | "
         "{} (the `--max-batch-size` cap) | {} whole-context slots fit that budget | >= 3x: {}x |",
         file, [("results.capacity.paged.median.peak_active_sequences", ".0f"),
                *((_target("capacity: running sequences / whole-context slots", figure), ".0f")
                  for figure in ("slots", "ratio"))]),
    ]


def _engine(contender: str, level: str) -> list[tuple[JsonPath, str]]:
    """generation: one contender's tokens/s, TTFT p50 / p99 and ITL p50 / p99 at one level
    (``llama.cpp``'s dot rules out a path)."""
    return [(lambda result, key=key: result["runs"][contender][level][key], spec)
            for key, spec in (("tokens_per_s", ",.0f"), ("ttft_p50_ms", ".1f"),
                              ("ttft_p99_ms", ".1f"), ("itl_p50_ms", "~"), ("itl_p99_ms", "~"))]


def _smollm2(contender: str, level: str) -> list[tuple[JsonPath, str]]:
    """generation --model smollm2: one contender's tokens/s, TTFT p50 and ITL p50 at one
    level (``llama.cpp``'s dot rules out a path)."""
    return [(lambda result, key=key: result["runs"][contender][level][key], spec)
            for key, spec in (("tokens_per_s", ",.1f"), ("ttft_p50_ms", ".1f"),
                              ("itl_p50_ms", ".2f"))]


def _host_ceiling(level: str) -> list[tuple[JsonPath, str]]:
    """host_ceiling: each contender's tokens/s and server CPU us a token at one level, then
    this checkout's speed-up over the baseline."""
    return [*((f"results.{who}.{level}.{key}", spec)
              for who in ("gpuflow", "gpuflow-thread-core", "baseline")
              for key, spec in (("tokens_per_s", ",.0f"), ("server_cpu_us_per_token", ".0f"))),
            (f"speedup_over_baseline.{level}", ".2f")]


FIGURES: list[Figure] = [
    (SERVE_DOC, "the tuned logits stay within {}e-7 of the eager step's (largest logit {}) and "
     "the greedy tokens agree in {} of {} steps for textlm tiny", AUTOTUNE,
     [_autotune("textlm-tiny")[0], ("results.textlm-tiny.max_abs_logit", ".2f"),
      *_autotune("textlm-tiny")[1:]]),
    (SERVE_DOC, "within {}e-7 and {} of {} for a 2-layer Llama config", AUTOTUNE,
     _autotune("llama-tiny")),
    *((SERVE_DOC, f"| {level} | {{}} tok/s | {{}} tok/s | {{}} ms, {{}} ms |", SERVING,
       [(f"generation.tokens_per_s.gpuflow.{level}", ",.0f"),
        (f"generation.tokens_per_s.gpuflow no cache.{level}", ",.0f"),
        (f"generation.runs.gpuflow.{level}.ttft_p50_ms", ".0f"),
        (f"generation.runs.gpuflow.{level}.itl_p50_ms", ".1f")]) for level in LEVELS),
    (SERVE_DOC, "stage's launch-bound model ran {}x faster as a CUDA graph on the same machine",
     H200, [("verdicts.cuda graphs.steps_per_s_ratio", ".1f")]),
    (SERVE_DOC, "measured the eager engine at {} / {} / {} / {} tok/s for 1 / 8 / 32 / 64 "
     "clients", GRAPHS_RUN,
     [(f"generation.tokens_per_s.gpuflow.{level}", ",.0f") for level in LEVELS]),
    (SERVE_DOC, "({} / {} / {} / {} tok/s, eager over the buckets)", GRAPHS_RUN,
     [(f"generation_cuda_graphs.tokens_per_s.gpuflow.{level}", ",.0f") for level in LEVELS]),
    (SERVE_DOC, "{} against {} tok/s at one client ({}x; rounds {}, {} and {}), {} against {} "
     "at 8 ({}x), {} against {} at 32 ({}x)", COMPILED,
     [*_against_llama_cpp("1"), *((f"runs.gpuflow.1.rounds.{i}.tokens_per_s", ".0f")
                                  for i in range(3)),
      *_against_llama_cpp("8"), *_against_llama_cpp("32")]),
    (SERVE_DOC, "gpuflow's one-client rounds fell from {} to {} tok/s while llama.cpp's held at "
     "{}-{}", COMPILED,
     [("runs.gpuflow.1.rounds.0.tokens_per_s", ".0f"),
      ("runs.gpuflow.1.rounds.2.tokens_per_s", ".0f"),
      *((lambda result, pick=pick: pick(round_["tokens_per_s"] for round_ in
                                        result["runs"]["llama.cpp"]["1"]["rounds"]), ",.0f")
        for pick in (min, max))]),
    (SERVE_DOC, "| `--concurrency 1` | dynamic batching | {} | {} | {} |",
     "serving-c1-intel-xeon-2c.json", _batching_run("dynamic", ".2f", ".2f")),
    (SERVE_DOC, "| | `--max-batch-size 1` | {} | {} | {} | same |",
     "serving-c1-intel-xeon-2c.json", _batching_run("max_batch_size_1", ".2f", ".2f")),
    (SERVE_DOC, "| 32 clients | dynamic batching | {} | {} | {} |",
     "serving-intel-r-xeon-r-2c.json", _batching_run("dynamic", ".1f", ".0f")),
    (SERVE_DOC, "| | `--max-batch-size 1` | {} | {} | {} | same |",
     "serving-intel-r-xeon-r-2c.json", _batching_run("max_batch_size_1", ".1f", ".0f")),
    (SERVE_DOC, "the model's batches stay small ({} rows on average)",
     "serving-intel-r-xeon-r-2c.json", [("runs.dynamic.mean_batch_rows", ".1f")]),
    *((SERVE_DOC, f"| {name} | {' | '.join(['{} ({})'] * 4)} |",
       "serving-contenders-intel-r-xeon-r-2c.json", _contender(server))
      for name, server in (("plain FastAPI endpoint, no batching", "fastapi_plain"),
                           ("LitServe 0.2.19, max batch 32, 5 ms", "litserve"),
                           ("gpuflow serve, max batch 32, 5 ms", "gpuflow"))),
    (SERVE_DOC, "| fp32 | {} | {}x | {} | | {} MiB |", QUANTIZE, _mode("fp32", True)),
    *((SERVE_DOC, f"| {name} | {{}} | {{}}x | {{}} | {{}} | {{}} MiB |", QUANTIZE,
       _mode(mode, True)) for name, mode in (("bf16", "bf16"), ("int8", "int8"),
                                             ("int8, bf16", "int8+bf16"))),
    *((SERVE_DOC, f"| {name} `--compile` | {{}} | {{}}x | | | {{}} MiB |", QUANTIZE,
       _mode(f"{name} compiled", False)) for name in ("fp32", "int8")),
    (SERVE_DOC, "compiling textlm tiny's decode step took {} s for the buckets up to 8 and {} s "
     "up to 32 on a first start, {}-{} s on a restart", "decode_warmup-amd-epyc-2c.json",
     [("results.8.cold_s", ".0f"), ("results.32.cold_s", ".0f"),
      ("results.8.warm_cache_s", ".0f"), ("results.32.warm_cache_s", ".0f")]),
    (SERVE_DOC, "the device thread's work {} ms a step and the host's {} ms, a step took {} ms "
     "left in flight ({}x the larger), against {} ms waited for ({}x)",
     "overlap-amd-epyc-2c.json",
     [("median.forward_ms", ".2f"), ("median.host_ms", ".2f"), ("median.overlapped_ms", ".2f"),
      ("overlapped_over_max_forward_host", ".2f"), ("median.waited_ms", ".2f"),
      ("waited_over_max_forward_host", ".2f")]),
    *((SERVE_DOC, f"| {name} | {step} | {{}} ({{}}{before}) | {{}} ({{}}) |",
       "launches-amd-epyc-2c.json", _launches(model, key))
      for name, model, step, key, before in (
          ("SmolLM2-135M-Instruct, 30 layers", "smollm2-135m-instruct", "8 decode rows",
           "decode", " before"),
          ("SmolLM2-135M-Instruct", "smollm2-135m-instruct", "8 decode rows and 2 prompt chunks",
           "decode_and_chunks", ""),
          ("the tests' 2-layer Llama", "hub-llama-2-layers", "8 decode rows", "decode", ""),
          ("the tests' 2-layer Llama", "hub-llama-2-layers",
           "8 decode rows and 2 prompt chunks", "decode_and_chunks", ""))),
    *((SERVE_DOC, f"| {rows} | {{}} | {{}} / {{}} / {{}} |", "attention_traffic-amd-epyc-2c.json",
       _traffic(rows)) for rows in (64, 256)),
    *(_hub_llama(route, level) for route in ("completions", "chat") for level in ("1", "8", "32")),
    (SERVE_DOC, "| code (a class, its methods alike) | {} tok/s | {} tok/s, {}x, {} accepted | "
     "{} tok/s, {}x, {} | {} tok/s, {}x, {} |", "speculative-amd-epyc-2c.json",
     _speculative("code")),
    (SERVE_DOC, "| prose (a docstring's sentences) | {} tok/s | {} tok/s, {}x, {} | {} tok/s, {}x, "
     "{} | {} tok/s, {}x, {} |", "speculative-amd-epyc-2c.json", _speculative("prose")),
    (SERVE_DOC, "it then decodes one client {}x faster ({} against {} tok/s", QUANTIZE,
     [(lambda result: result["modes"]["fp32 compiled"]["decode_tokens_per_s"]
       / result["modes"]["fp32"]["decode_tokens_per_s"], ".1f"),
      ("modes.fp32 compiled.decode_tokens_per_s", ",.0f"),
      ("modes.fp32.decode_tokens_per_s", ",.0f")]),
    (SERVE_DOC, "On a CPU, int8 weights are {}x smaller", QUANTIZE,
     [(lambda result: result["modes"]["fp32"]["state_dict_bytes"]
       / result["modes"]["int8"]["state_dict_bytes"], ".1f")]),
    *_kv_paging("kv_paging-amd-epyc-2c.json", ".0f", ", `--kv-cache-gib 0.25`"),
    *_kv_paging("kv_paging-hub-llama-amd-epyc-2c.json", ".1f", ""),
    (SERVE_DOC, "the cached run's ITL p50 is {} ms and its TTFT p50 {} ms",
     "kv_paging-amd-epyc-2c.json", [("results.prefix.prefix cache.median.itl_p50_ms", ".1f"),
                                    ("results.prefix.prefix cache.median.ttft_p50_ms", ".0f")]),
    *((SERVE_DOC, f"| {level} | {{}} tok/s; TTFT {{}} / {{}} ms; ITL {{}} / {{}} ms | {{}} "
       f"tok/s{errors}; TTFT {{}} / {{}} ms; ITL {{}} / {{}} ms | {{}}x", EAGER,
       [*_engine("gpuflow", level), *_engine("llama.cpp", level),
        _against_llama_cpp(level)[2]])
      for level, errors in (("1", ""), ("8", ", 1 error"), ("32", ", 1 error"))),
    *((SERVE_DOC, f"| {rows} | {{}} | {{}} | {{}} | {{}} |", LAYOUT,
       [*((f"results.fp32.model.{rows}.{layout}_ms", ".1f")
          for layout in ("usual", "input_major", "onednn_packed")),
        (f"results.bf16.model.{rows}.usual_ms", ".1f")]) for rows in (1, 4, 8, 16, 32, 128)),
    *((SERVE_DOC, f"| {level} | {{}} ({{}} us) | {{}} ({{}} us) | {{}} ({{}} us) | {{}}x |",
       CEILING, _host_ceiling(level)) for level in ("1", "64", "256")),
    *((SERVE_DOC, f"{{}} {where} (this checkout then {{}}x and {{}}x", f"{CEILING}@{commit}",
       [("results.baseline.256.tokens_per_s", ",.0f"), ("speedup_over_baseline.64", ".2f"),
        ("speedup_over_baseline.256", ".2f")])
      for where, commit in (("tok/s in the file at 9aec944", "9aec944"),
                            ("in the file at f2901a2", "f2901a2"))),
    (SERVE_DOC, "against {} in this run", CEILING, [("results.baseline.256.tokens_per_s", ",.0f")]),
    (SERVE_DOC, "On an AMD EPYC (`benchmarks/results/host_ceiling-amd-epyc-2c.json`, before "
     "this page's CPU products and greedy ids) {}x and {}x at 64 and 256 clients",
     "host_ceiling-amd-epyc-2c.json",
     [("speedup_over_baseline.64", ".2f"), ("speedup_over_baseline.256", ".2f")]),
    *((SERVE_DOC, f"| {level} | {{}} tok/s; TTFT p50 {{}} ms; ITL p50 {{}} ms | {{}} tok/s; "
       f"TTFT p50 {{}} ms; ITL p50 {{}} ms | {{}}x (>= {target}x)", SMOLLM2,
       [*_smollm2("gpuflow", level), *_smollm2("llama.cpp", level),
        (lambda result, level=level: result["targets"][f"gpuflow vs llama.cpp c{level}"]
         ["tokens_per_s_ratio"], ".2f")])
      for level, target in (("1", "0.8"), ("8", "1.0"))),
    (SERVE_DOC, "At 8 clients the rounds gave {}x, {}x, {}x", SMOLLM2,
     [(lambda result, i=i: result["runs"]["gpuflow"]["8"]["rounds"][i]["tokens_per_s"]
       / result["runs"]["llama.cpp"]["8"]["rounds"][i]["tokens_per_s"], ".3f")
      for i in range(3)]),
    (STRUCTURED_DOC, "| tokens/s, 32 clients unconstrained | {} | | | tokens/s, 16 of them "
     "constrained by a 10-field schema | {} | | | ratio (median of the rounds' ratios) | {}x | "
     ">= 0.9x |", STRUCTURED, [("cost.tokens_per_s.unconstrained", ",.0f"),
                               ("cost.tokens_per_s.half_constrained", ",.0f"),
                               ("cost.ratio_median", ".2f")]),
    (STRUCTURED_DOC, "| TTFT at 1 client, unconstrained (median of 20) | {} ms | | | TTFT, the "
     "cached 10-field schema | {} ms (+{} ms) | <= +1 ms | | TTFT, a 20-field schema new each "
     "time | {} ms (+{} ms) | <= +50 ms |", STRUCTURED,
     [("ttft.median_ms.unconstrained", ".2f"), ("ttft.median_ms.cached_schema", ".2f"),
      ("ttft.cached_added_ms", ".2f"), ("ttft.median_ms.new_schema", ".2f"),
      ("ttft.new_added_ms", ".2f")]),
    (STRUCTURED_DOC, "| {} s in {} steps ({} ms a step) |", STRUCTURED,
     [("cost.grammar_mask.sum_s", ".1f"), ("cost.grammar_mask.steps", ",.0f"),
      (lambda result: 1000 * result["cost"]["grammar_mask"]["sum_s"]
       / result["cost"]["grammar_mask"]["steps"], ".2f")]),
    (SERVE_DOC, "base gave {} tok/s, client `i` naming adapter `i % 8` gave {} tok/s, "
     "**{}x** (issue 52's target: 0.8x; the rounds gave {}x, {}x and {}x). A mixed step took "
     "{} ms against {} ms, {}x", LORA,
     [("tokens_per_s.base", ".1f"), ("tokens_per_s.mixed", ".1f"), ("ratio_median", ".3f"),
      *((f"rounds.{i}.ratio", ".3f") for i in range(3)), ("mean_step_ms.mixed", ".1f"),
      ("mean_step_ms.base", ".1f"), ("step_ms_ratio", ".2f")]),
    (STRUCTURED_DOC, "The rounds gave {}x, {}x and {}x", STRUCTURED,
     [(f"cost.rounds.{i}.ratio", ".2f") for i in range(3)]),
    (STRUCTURED_DOC, "| unconstrained | {} | {} | {} stop, {} length | | `response_format` "
     "`json_schema` | {} | {} | {} stop |", STRUCTURED,
     [("quality.unconstrained.valid", ".0%"), ("quality.unconstrained.lenient", ".0%"),
      ("quality.unconstrained.finish_reasons.stop", ".0f"),
      ("quality.unconstrained.finish_reasons.length", ".0f"),
      ("quality.constrained.valid", ".0%"), ("quality.constrained.lenient", ".0%"),
      ("quality.constrained.finish_reasons.stop", ".0f")]),
]
