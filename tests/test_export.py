import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from user_workloads import TinyMLP, mlp

from gpuflow import TrainConfig, train
from gpuflow.cli import main


def test_export_writes_the_final_weights_with_the_run_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = train(mlp(), TrainConfig(max_steps=5, batch_size=32, progress=False,
                                      run_dir=str(run_dir), workload="user_workloads:mlp"))
    out = tmp_path / "export" / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    weights = load_file(out)
    fresh = TinyMLP()
    fresh.load_state_dict(weights)
    for name, tensor in result.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    with safe_open(out, "pt") as handle:
        metadata = handle.metadata()
    assert metadata["step"] == "5" and metadata["workload"] == "user_workloads:mlp"
    assert json.loads(metadata["config"])["max_steps"] == 5


def test_export_of_a_dir_without_checkpoints_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "not a gpuflow run dir" in capsys.readouterr().err
