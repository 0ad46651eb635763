"""--cuda-graphs: its refusals, which the CPU can check (the speed-up needs a GPU:
benchmarks/gpu_suite.py measures it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gpuflow.cli import main
from gpuflow.errors import UserError
from gpuflow.train import cuda_graphs


@pytest.mark.parametrize(("flags", "message"), [
    (("--workload", "textlm"), "needs a CUDA device; this run is on cpu"),
    (("--workload", "speech"), "workload 'speech' makes batches of different shapes"),
    (("--workload", "textlm", "--nproc", "2"), "with --strategy ddp, DDP all-reduces"),
    (("--workload", "textlm", "--strategy", "fsdp"), "with --strategy fsdp, FSDP2 gathers"),
    (("--workload", "textlm", "--strategy", "pp", "--nproc", "2"), "the pipeline schedule"),
    (("--workload", "textlm", "--grad-accum", "2"), "with --grad-accum 2: the captured"),
    (("--workload", "textlm", "--batch-size", "auto"), "auto, which may accumulate"),
])
def test_cuda_graphs_are_refused_where_they_cannot_run(
        flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    code = main(["train", *flags, "--data", "synthetic", "--device", "cpu", "--cuda-graphs",
                 "--max-steps", "1", "--no-progress", "--run-dir", str(tmp_path)])
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_dataset_of_one_shape_passes_the_probe() -> None:
    dataset = TensorDataset(torch.randn(40, 3), torch.zeros(40, dtype=torch.long))
    cuda_graphs.check_static_shapes(dataset, torch.utils.data.default_collate, "fixed")


def test_a_batch_of_another_shape_stops_the_graphed_model() -> None:
    """Streams are not probed before the run: the guard stops them at the first odd batch."""
    guarded = cuda_graphs.StaticShapes(nn.Linear(4, 2))
    assert guarded(torch.ones(3, 4)).shape == (3, 2)
    assert guarded(torch.zeros(3, 4)).shape == (3, 2)
    with pytest.raises(UserError, match=r"a batch of shape \[5, 4\] after batches of \[3, 4\]"):
        guarded(torch.ones(5, 4))
