"""The planner counts a LoRA run (issue 52): a frozen base without gradients or optimizer
state, held as loaded (16-bit, or NF4 codes), and fp32 adapters with both. Its predicted peak
is within the planner's stated bound (docs/planner.md: 15%) of MemTracker's count of real
training steps, below the full fine-tune's; `gpuflow plan` prints it, and `--strategy auto`
runs adapters on a layout that trains them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from planner_layouts import measured_peak

from gpuflow import TrainConfig, lora, train
from gpuflow.cli import main
from gpuflow.planner.layout import Layout
from gpuflow.planner.memory import predict_memory
from gpuflow.planner.workload_profile import profile_workload
from gpuflow.precision import autocast_dtype
from gpuflow.workload import Workload, resolve_workload

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning"),
              # torch's MemTracker warns of the Llama's module hierarchy, full runs too.
              pytest.mark.filterwarnings("ignore:The module hierarchy tracking:UserWarning")]

TOLERANCE = 0.15  # docs/planner.md's bound for every case its tests assert
SEQ = 64
LAYOUTS = {"fp32": Layout(strategy="single", precision="fp32", micro_batch=4),
           "bf16": Layout(strategy="single", precision="bf16", micro_batch=4)}


@pytest.fixture(scope="module")
def directories(hub_models: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama as saved in fp32, and again in bf16 (a 16-bit base stays 16-bit)."""
    import transformers

    source = hub_models["llama"]
    bf16 = tmp_path_factory.mktemp("planner-lora") / "llama-bf16"
    shutil.copytree(source, bf16)
    transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.bfloat16).save_pretrained(bf16)
    return {"fp32": source, "bf16": bf16}


def adapted(directory: Path, precision: str, spec: lora.LoraSpec | None) -> Workload:
    """The workload as `gpuflow train` builds and wraps it under ``precision``."""
    workload = resolve_workload(f"hf:{directory}", {"data": "synthetic", "seq_len": SEQ},
                                frozen_precision=precision if spec else None)
    lora.wrap(workload.model, spec, autocast_dtype(precision))
    return workload


@pytest.mark.parametrize(("precision", "quantize"), [("fp32", None), ("bf16", None),
                                                     ("bf16", "nf4")])
def test_adapter_peaks_are_predicted_within_the_planners_bound_and_below_full(
        directories: dict[str, Path], precision: str, quantize: str | None) -> None:
    directory, layout = directories[precision], LAYOUTS[precision]
    workload = adapted(directory, precision, lora.LoraSpec(4, quantize=quantize))
    profile = profile_workload(workload, precision, fsdp=False)
    predicted = predict_memory(profile, layout).peak
    measured = measured_peak(workload, layout)
    assert abs(predicted / measured - 1) < TOLERANCE, (predicted, measured)
    full = profile_workload(adapted(directory, precision, None), precision, fsdp=False)
    assert predicted < predict_memory(full, layout).peak
    assert 0 < profile.trained_fraction < 0.1


def _planned_peak(directory: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> float:
    code = main(["plan", "--workload", f"hf:{directory}", "--gpus", "1", "--gpu-type", "h100",
                 "--seq-len", str(SEQ), "--global-batch", "4", "--json", *flags])
    assert code == 0
    return float(json.loads(capsys.readouterr().out)["recommended"]["memory_bytes"]["peak"])


def test_plan_prints_the_peak_of_lora_and_qlora_runs(
        directories: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    full = _planned_peak(directories["bf16"], capsys)
    adapters = _planned_peak(directories["bf16"], capsys, "--lora-rank", "16")
    quantized = _planned_peak(directories["bf16"], capsys, "--lora-rank", "16",
                              "--quantize-base", "nf4")
    assert quantized < adapters < full


def test_plan_offers_an_nf4_base_on_several_devices_only_sharded(
        directories: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--workload", f"hf:{directories['bf16']}", "--gpus", "2",
                 "--gpu-type", "h100", "--lora-rank", "4", "--quantize-base", "nf4", "--json"])
    assert code == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and {plan["strategy"] for plan in plans} == {"fsdp"}


def test_strategy_auto_trains_adapters_on_the_planners_layout(
        directories: dict[str, Path], tmp_path: Path) -> None:
    directory = directories["bf16"]
    config = TrainConfig(workload=f"hf:{directory}", data="synthetic", seq_len=SEQ,
                         max_steps=1, batch_size=2, eval_every=0, progress=False,
                         precision="bf16", strategy="auto", lora_rank=4, quantize_base="nf4",
                         run_dir=str(tmp_path / "run"))
    workload = resolve_workload(f"hf:{directory}", {"data": "synthetic", "seq_len": SEQ},
                                frozen_precision=config.frozen_precision())
    result = train(workload, config)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    plan, trained = summary["plan"]["strategy_auto"], summary["trainable_params"]
    assert plan["strategy"] == "single" and plan["fits"]
    assert trained < sum(p.numel() for p in result.model.parameters())
    # AdamW's two fp32 moments for the adapters alone, and their fp32 gradients.
    assert plan["memory_bytes"]["optimizer"] == 8 * trained
    assert plan["memory_bytes"]["gradients"] == 4 * trained
