"""--cuda-graphs: its refusals, which the CPU can check (the speed-up needs a GPU:
benchmarks/gpu_suite.py measures it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

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


class Clips(Dataset):
    """Clips of 3 samples, but for the last ``longer`` which have 5; records what is read."""

    def __init__(self, longer: int) -> None:
        self.longer, self.read = longer, set()

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        self.read.add(index)
        return torch.zeros(5 if index >= 40 - self.longer else 3)


def padded(clips: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(clips, batch_first=True)  # to the batch's longest


def test_the_probe_reads_across_the_dataset_and_passes_only_one_shape() -> None:
    """Batches from its start to its end are collated: one shape passes, and a dataset whose
    last clips alone are longer is refused."""
    fixed = Clips(longer=0)
    cuda_graphs.check_static_shapes(fixed, padded, "fixed")
    assert {0, 39} <= fixed.read
    with pytest.raises(UserError, match=r"workload 'tail' makes batches of different shapes"):
        cuda_graphs.check_static_shapes(Clips(longer=2), padded, "tail")


def test_a_batch_of_another_shape_stops_the_graphed_model() -> None:
    """Streams are not probed before the run: the guard stops them at the first odd batch."""
    guarded = cuda_graphs.StaticShapes(nn.Linear(4, 2))
    assert guarded(torch.ones(3, 4)).shape == (3, 2)
    assert guarded(torch.zeros(3, 4)).shape == (3, 2)
    with pytest.raises(UserError, match=r"a batch of shape \[5, 4\] after batches of \[3, 4\]"):
        guarded(torch.ones(5, 4))
