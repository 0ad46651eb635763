"""`gpuflow plan --measure`: it measures only the GPU type planned for, by training the real
model, and every plan says where its efficiency came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpuflow import TrainConfig, Trainer
from gpuflow.cli import main
from gpuflow.devices import cpu_peak, total_memory
from gpuflow.errors import UserError
from gpuflow.planner import measure
from gpuflow.planner.cost import predict_step_time
from gpuflow.planner.layout import Layout
from gpuflow.planner.machine import DEFAULT_EFFICIENCY, cpu_hardware, gpu_hardware
from gpuflow.planner.workload_profile import profile_workload
from gpuflow.train.calibrate import measure_efficiency
from gpuflow.workload import resolve_workload


def test_measure_refuses_a_machine_without_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the refusal is for machines without one")
    assert main(["plan", "--measure", "--workload", "textlm", "--gpu-type", "h200",
                 "--gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert "which has no GPU: a CPU's rate says nothing about --gpu-type h200" in err


def test_measure_refuses_another_gpu_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match="not the --gpu-type h200 planned for "
                                        r"\(plan for it with --gpu-type a100-80g\)"):
        measure.check_measurable("h200")
    assert measure.check_measurable("a100-80g") == "NVIDIA A100-SXM4-80GB"


def test_every_plan_names_its_efficiency(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_hardware("h100", 8).efficiency == DEFAULT_EFFICIENCY
    assert gpu_hardware("h100", 8).efficiency_source.startswith("default 0.45, not measured")
    assert gpu_hardware("h100", 8, efficiency=0.5).efficiency_source == "--efficiency"
    assert main(["plan", "--transformer", "llama3-8b", "--json"]) == 0
    hardware = json.loads(capsys.readouterr().out)["hardware"]
    assert hardware["efficiency_source"].startswith("default 0.45")


def test_an_efficiency_measured_on_one_configuration_predicts_others_by_their_work(
        tmp_path: Path) -> None:
    """The efficiency is one run's MFU by the trainer's count, optimizer and all. Calibrated
    on micro-batch 4 of a 2x64 textlm, the planner predicts micro-batch 16 and a 4x128 model
    from its own FLOP count (a trace): the measured step scaled by the trainer's FLOP count
    of each, so both counts agree at every size, whatever the load did to the measured step.
    How close such predictions come to measured steps moves with the machine's load:
    benchmarks/planner_steps.py measures it (``calibration``)."""
    calibrated = {"data": "synthetic", "model_size": "layers=2,dim=64,heads=2,seq=32"}
    measured = measure_efficiency(resolve_workload("textlm", calibrated), "fp32", 4,
                                  device="cpu", steps=6)
    assert 0 < measured.efficiency <= 1
    assert measured.efficiency == pytest.approx(
        measured.flops_per_step / measured.step_time_s / measured.peak_flops)
    assert "measured: MFU" in measured.describe() and "micro-batch 4" in measured.describe()
    peaks = {key: cpu_peak(key).flops for key in ("fp32", "tf32", "bf16", "fp16")}
    hardware = cpu_hardware(1, peaks, total_memory() or 2**34, efficiency=measured.efficiency)
    others = [(calibrated, 16),
              ({"data": "synthetic", "model_size": "layers=4,dim=128,heads=2,seq=64"}, 4)]
    for spec, micro_batch in others:
        with torch.device("meta"):
            profile = profile_workload(resolve_workload("textlm", spec), "fp32")
        predicted = predict_step_time(profile, Layout(strategy="single", micro_batch=micro_batch),
                                      hardware).step_s
        trainer = Trainer(resolve_workload("textlm", spec), TrainConfig(
            workload="textlm", device="cpu", batch_size=micro_batch, max_steps=1,
            save_checkpoints=False, progress=False, run_dir=str(tmp_path / str(micro_batch))))
        work = trainer.flops_per_step
        trainer.close()
        assert work > measured.flops_per_step
        assert predicted == pytest.approx(
            measured.step_time_s * work / measured.flops_per_step, rel=0.05), spec
