"""Importing gpuflow is cheap, and its public names still resolve on first use."""

from __future__ import annotations

import json
import subprocess
import sys

import gpuflow


def test_import_gpuflow_loads_neither_the_trainer_nor_torch_distributed() -> None:
    code = ("import json, sys, gpuflow, gpuflow.errors; "
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.startswith(('gpuflow', 'torch')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    loaded = json.loads(out)
    assert not any(m == "torch.distributed" or m.startswith("torch.distributed.") for m in loaded)
    assert not any(m.startswith("gpuflow.train") for m in loaded)
    assert "gpuflow.errors" in loaded


def test_public_names_resolve() -> None:
    from gpuflow import RunResult, TrainConfig, Trainer, UserError, Workload, train
    from gpuflow.config import TrainConfig as config_class
    from gpuflow.train.trainer import Trainer as trainer_class
    from gpuflow.train.trainer import train as train_function

    assert Trainer is trainer_class and gpuflow.Trainer is trainer_class
    assert TrainConfig is config_class
    assert train is train_function and gpuflow.train is train_function
    assert RunResult.__name__ == "RunResult" and Workload.__name__ == "Workload"
    assert issubclass(UserError, Exception)
    for name in gpuflow.__all__:
        assert getattr(gpuflow, name) is not None
    assert set(gpuflow.__all__) <= set(dir(gpuflow))


def test_unknown_names_raise_attribute_error() -> None:
    try:
        gpuflow.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("gpuflow.no_such_name resolved")
