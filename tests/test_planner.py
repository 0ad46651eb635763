"""The planner's model of time and its search: the orders it predicts, ZeRO's model states,
DDP buckets, FSDP prefetch, the candidates it weighs, --batch-size auto and `gpuflow plan`.
Its peak-memory predictions are measured in test_planner_memory.py; its step times against
measured ones, which move with the machine's load, in benchmarks/planner_steps.py."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import torch
from conftest import run_cli
from planner_layouts import (
    COMPUTE_BOUND_LAYOUTS,
    MEDIUM_GPT,
    SMALL_GPT,
    TIMED_LAYOUTS,
    batch_of,
    workload_of,
)

from gpuflow.config import TrainConfig
from gpuflow.planner import choose_plan, find_max_batch_size
from gpuflow.planner.batch_size import accumulation_for
from gpuflow.planner.cost import predict_step_time
from gpuflow.planner.layout import Layout
from gpuflow.planner.machine import cpu_hardware, gpu_hardware
from gpuflow.planner.memory import model_state_bytes, predict_memory
from gpuflow.planner.search import search
from gpuflow.planner.workload_profile import profile_workload
from gpuflow.train.optim import build_optimizer
from gpuflow.workload import resolve_workload


def test_strategies_are_predicted_in_the_order_measured_on_two_ranks() -> None:
    """textlm 2x64 at global batch 8 on 2 gloo ranks measured ddp < fsdp as one unit < fsdp
    without resharding < fsdp < tp (benchmarks/planner_steps.py, ``two_ranks``, where the
    measurement lives: step times move with the machine's load). Every layout does the same
    FLOPs per rank, so the order rests on the model of communication, whatever the rate."""
    profile = profile_workload(workload_of("textlm", SMALL_GPT), "fp32")
    for peak in (1e10, 1e11, 1e12):
        hardware = cpu_hardware(2, {"fp32": peak}, 2**34)
        predicted = {name: predict_step_time(profile, layout, hardware).step_s
                     for name, layout in TIMED_LAYOUTS.items()}
        assert sorted(predicted, key=predicted.get) == [
            "ddp", "fsdp-model", "fsdp-no-reshard", "fsdp", "tp"], (peak, predicted)


def test_equally_fast_plans_are_ranked_by_their_collective_calls() -> None:
    """Where compute hides every difference the model of time sees, the plan with fewer
    collective calls goes first: measured on 2 gloo ranks (benchmarks/planner_steps.py),
    ddp, fsdp as one unit, fsdp without and with resharding come in that order, which the
    calls follow."""
    profile = profile_workload(workload_of("textlm", SMALL_GPT), "fp32")
    hardware = cpu_hardware(2, {"fp32": 1e8}, 2**34)
    plans = [plan for plan in search({"fp32": profile}, hardware, 8, tensor_parallel=False,
                                     pipeline=False) if not plan.activation_checkpointing]
    assert len({f"{plan.time.step_s:.3g}" for plan in plans}) == 1, plans
    assert [plan.layout.describe() for plan in plans] == [
        "ddp dp2xtp1xpp1", "fsdp(model) dp2xtp1xpp1", "fsdp(no-reshard) dp2xtp1xpp1",
        "fsdp dp2xtp1xpp1"]


def test_a_one_micro_batch_pipeline_is_predicted_slowest_where_compute_dominates() -> None:
    """The model of time charges a 2-stage pipeline with one micro-batch a bubble of a whole
    stage: each rank waits through the other's share, about twice ddp's step, whatever the
    compute rate. How that compares with measured steps is benchmarks/planner_steps.py's
    ``compute_bound`` (docs/planner.md quotes it)."""
    profile = profile_workload(workload_of("textlm", MEDIUM_GPT), "fp32")
    for peak in (2e10, 1e11, 2e11):
        hardware = cpu_hardware(2, {"fp32": peak}, 2**34)
        predicted = {name: predict_step_time(profile, layout, hardware).step_s
                     for name, layout in COMPUTE_BOUND_LAYOUTS.items()}
        assert predicted["ddp"] < predicted["fsdp"] < predicted["pp"], (peak, predicted)
        assert predicted["pp"] > 1.25 * predicted["ddp"], (peak, predicted)


def test_precision_and_checkpointing_change_the_predicted_step_as_the_peaks_say() -> None:
    """A CPU with AMX runs bf16 matmuls several times faster than fp32, one without native
    bf16 slower: the predicted order follows the peaks given (measured steps against these
    predictions: benchmarks/planner_steps.py, ``precision``). Checkpointing adds a forward."""
    workload = resolve_workload("textlm", {"data": "synthetic",
                                           "model_size": "layers=2,dim=512,heads=4,seq=128"})
    profiles = {key: profile_workload(workload, key) for key in ("fp32", "bf16")}

    def step(peaks: dict[str, float], precision: str, **layout: Any) -> float:
        return predict_step_time(profiles[precision], Layout(
            strategy="single", precision=precision, micro_batch=4, **layout),
            cpu_hardware(1, peaks, 2**34)).step_s

    amx, emulated = {"fp32": 2e11, "bf16": 1.6e12}, {"fp32": 2e11, "bf16": 5e10}
    assert step(amx, "bf16") < step(amx, "fp32")
    assert step(emulated, "bf16") > step(emulated, "fp32")
    assert step(amx, "fp32", activation_checkpointing=True) == pytest.approx(
        step(amx, "fp32") * 4 / 3)


def test_zero_stage_model_states_match_the_paper() -> None:
    """ZeRO (Rajbhandari et al. 2020, Figure 1): 7.5B parameters, 64 GPUs, K = 12."""
    psi = 7.5e9
    stages = [(False, False, False), (True, False, False), (True, True, False),
              (True, True, True)]
    paper_gb = [120, 31.4, 16.6, 1.88]
    for (opt, grad, param), expected in zip(stages, paper_gb, strict=True):
        got = model_state_bytes(psi, 64, opt, grad, param, param_bytes=2, grad_bytes=2,
                                optimizer_bytes=12) / 1e9
        assert got == pytest.approx(expected, rel=0.01)


def test_ddp_bucket_size_sets_its_all_reduce_calls() -> None:
    """DDP all-reduces its gradients one bucket at a time, each call paying the link's
    latency: --bucket-mb reaches the planner's DDP layouts."""
    workload = resolve_workload("textlm", {"data": "synthetic", "model_size": SMALL_GPT})
    profile = replace(profile_workload(workload, "bf16"), params=100_000_000)
    hardware = gpu_hardware("h100", 8)
    gradients = 4 * profile.params  # fp32

    def ddp(bucket_mb: float | None) -> tuple[Any, Any]:
        layout = Layout(strategy="ddp", dp=8, precision="bf16", micro_batch=4, bucket_mb=bucket_mb)
        time = predict_step_time(profile, layout, hardware)
        return next(c for c in time.collectives if "DDP" in c.name), time

    (default, default_time), (small, small_time) = ddp(None), ddp(1.0)
    assert default.count == round(gradients / (25 * 2**20))
    assert small.count == round(gradients / 2**20)
    assert small.count * small.message_bytes == pytest.approx(gradients)
    assert small_time.comm_s > default_time.comm_s  # 381 latencies instead of 15
    plan = choose_plan(workload, TrainConfig(precision="bf16", batch_size=4, bucket_mb=1.0),
                       hardware)
    assert plan.layout.bucket_mb == 1.0


def test_fsdp_prefetch_holds_more_blocks_gathered_and_keeps_per_block_plans() -> None:
    """--fsdp-prefetch N holds the running block and N more gathered, where FSDP alone holds
    two; a run that asks for it is planned per block, and --strategy auto passes it (and
    --bucket-mb) to the plans it weighs."""
    from gpuflow.planner.layout import RunSettings
    from gpuflow.train.auto import plan_strategy

    workload = resolve_workload("textlm", {"data": "synthetic", "model_size": SMALL_GPT})
    profile = profile_workload(workload, "bf16", fsdp=True)
    per_block = profile.block_params / profile.layers
    # A micro-batch of 1: the parameters, not the activations, set the peak.
    peaks = {depth: predict_memory(profile, Layout(strategy="fsdp", dp=8, precision="bf16",
                                                   fsdp_prefetch=depth)).peak
             for depth in (None, 1, 3)}
    assert peaks[1] == peaks[None]
    assert peaks[3] - peaks[None] == pytest.approx(2 * 2 * per_block)  # two more bf16 blocks

    hardware = gpu_hardware("h100", 8)
    plans = search({"bf16": profile}, hardware, 32, pipeline=False,
                   settings=RunSettings(fsdp_prefetch=2, bucket_mb=4.0))
    assert {plan.layout.fsdp_prefetch for plan in plans} == {2}
    assert {plan.layout.bucket_mb for plan in plans} == {4.0}
    assert "fsdp(model)" not in {plan.layout.describe().split()[0] for plan in plans}
    _, plan = plan_strategy(workload, TrainConfig(precision="bf16", batch_size=4,
                                                  bucket_mb=4.0, fsdp_prefetch=2), 2)
    assert (plan.layout.bucket_mb, plan.layout.fsdp_prefetch) == (4.0, 2)


def test_choose_plan_returns_a_plan_the_trainer_can_apply() -> None:
    workload = resolve_workload("textlm", {"data": "synthetic", "model_size": SMALL_GPT})
    hardware = gpu_hardware("h100", 8)
    plan = choose_plan(workload, TrainConfig(precision="bf16", batch_size=4), hardware)
    assert plan.fits and plan.dp * plan.tp * plan.pp == 8
    assert plan.micro_batch * plan.grad_accum * plan.dp == 4 * 8
    assert plan.strategy in ("ddp", "fsdp", "tp", "single")
    assert 0 < plan.predicted_peak_bytes <= hardware.memory_bytes
    assert plan.predicted_step_s > 0
    tiny_memory = replace(hardware, memory_bytes=1)
    with pytest.raises(Exception, match="No plan fits"):
        choose_plan(workload, TrainConfig(precision="bf16"), tiny_memory)


def test_candidates_are_the_layouts_the_trainer_runs_by_its_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On every mesh the planner proposes what ParallelDims.runnable gives, so a pipeline is
    pp alone or fsdp with pp > 1 (never ddp, tp or single with stages, nor tp with pp), and
    --strategy auto applies a plan's layout to the config field for field."""
    from dataclasses import fields

    from gpuflow.parallel.dims import ParallelDims
    from gpuflow.planner.search import candidate_layouts, evaluate
    from gpuflow.train import auto

    layouts = list(candidate_layouts(8, 16, ["bf16"], 8, True, True, 8))
    for dp, tp, pp in {(lay.dp, lay.tp, lay.pp) for lay in layouts}:
        proposed = {lay.describe() for lay in layouts if (lay.dp, lay.tp, lay.pp) == (dp, tp, pp)}
        assert proposed == {dims.describe() for dims in ParallelDims.runnable(dp, tp, pp)}
    pipelines = {lay.describe() for lay in layouts if lay.pp > 1}
    assert "pp dp1xtp1xpp8" in pipelines and "fsdp dp4xtp1xpp2" in pipelines
    assert all(lay.strategy in ("pp", "fsdp") and lay.tp == 1 for lay in layouts if lay.pp > 1)

    workload = workload_of("textlm", SMALL_GPT)
    pipelined = next(lay for lay in layouts if lay.describe() == "fsdp(no-reshard) dp4xtp1xpp2")
    plan = evaluate({"bf16": profile_workload(workload, "bf16")}, pipelined,
                    gpu_hardware("h100", 8))
    monkeypatch.setattr(auto, "choose_plan", lambda *_: plan)
    config, chosen = auto.plan_strategy(workload, TrainConfig(precision="bf16", batch_size=2), 8)
    assert chosen is plan
    assert ParallelDims.from_config(config, 8) == ParallelDims(
        **{f.name: getattr(pipelined, f.name) for f in fields(ParallelDims)})
    assert (config.batch_size, config.grad_accum) == (pipelined.micro_batch,
                                                      pipelined.grad_accum)


def test_batch_size_auto_finds_the_largest_fitting_micro_batch_and_leaks_nothing() -> None:
    workload = resolve_workload("textlm", {"data": "synthetic", "model_size": SMALL_GPT})
    model = workload.model
    optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"))

    def step(size: int) -> None:
        inputs, target = batch_of(workload, size)
        workload.loss_fn(model(inputs), target).backward()

    profile = profile_workload(workload, "fp32")
    budget = int(predict_memory(profile, Layout(strategy="single", micro_batch=12)).peak)
    found = find_max_batch_size(step, tracked=[model, optimizer], memory_cap=budget)
    assert 6 <= found <= 24
    assert all(p.grad is None for p in model.parameters())
    assert find_max_batch_size(step, tracked=[model, optimizer], memory_cap=budget,
                               start=found, limit=found + 1) == found
    assert accumulation_for(64, 2, found) == (max(d for d in range(1, found + 1)
                                                  if 32 % d == 0), 32 // max(
        d for d in range(1, found + 1) if 32 % d == 0))
    with pytest.raises(Exception, match="memory cap"):
        find_max_batch_size(step)


def test_plan_cli_table_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from gpuflow.cli import main

    assert main(["plan", "--transformer", "llama3-8b", "--gpus", "8", "--gpu-type", "h100",
                 "--global-batch", "16", "--json", "--no-pipeline"]) == 0
    report = json.loads(capsys.readouterr().out)
    best = report["recommended"]
    assert best["fits"] and best["global_batch"] == 16
    assert report["reason"].startswith("Run ")
    assert any(not p["fits"] for p in report["plans"])
    assert main(["plan", "--transformer", "llama3-8b", "--global-batch", "16", "--json",
                 "--no-pipeline", "--fsdp-prefetch", "2"]) == 0
    prefetched = json.loads(capsys.readouterr().out)["plans"]
    assert {p["fsdp_prefetch"] for p in prefetched} == {2}
    assert "model" not in {p["fsdp_wrap"] for p in prefetched}
    assert main(["plan", "--transformer", "llama3-8b", "--fsdp-prefetch", "0"]) == 2
    assert "--fsdp-prefetch must be at least 1" in capsys.readouterr().err
    assert main(["plan", "--workload", "digits", "--gpus", "2", "--gpu-type", "a100-80g",
                 "--precision", "fp32,bf16"]) == 0
    table = capsys.readouterr().out
    assert "Candidate plans" in table and "Run " in table
    assert main(["plan", "--workload", "digits", "--gpus", "2", "--gpu-type", "a100-80g",
                 "--precision", "fp32,bf16", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)["model"]
    assert models["fp32"]["with_low_precision_params"] is None
    assert models["bf16"]["with_low_precision_params"]["precision"] == "bf16"
    bad = run_cli("plan", "--gpu-type", "h900", "--transformer", "llama3-8b")
    assert bad.returncode == 2
    assert "h100" in bad.stderr and "a100-80g" in bad.stderr
