"""A loss weighed by its units (``Workload.loss_units``, gpuflow.train.units): two DDP ranks
whose asr batches hold different numbers of target characters train as one process on
their union batch does, and so do two accumulated micro-batches; without the weights they
would not."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from runs import losses
from torch import nn

from gpuflow import TrainConfig, train
from gpuflow.models.asr import ConformerCTC
from gpuflow.parallel.env import free_port
from gpuflow.parallel.pipeline_state import StageNames
from gpuflow.workload import Workload
from gpuflow.workloads import asr
from gpuflow.workloads.asr_synthetic import SyntheticUtterances

# Synthetic utterances of 1.2-1.6 s: rank 0 holds one of 9 characters, rank 1 three of 78.
SPLIT = ([17], [31, 25, 56])
STEPS = 2
# fp32, the union's padded shapes summing in another order than each rank's. Measured here:
# losses within 1.3e-7 relative; each parameter tensor within 1.6e-6 of its largest value
# (the worst a zero-initialised bias, so of what the two steps moved it). Two pipeline
# stages, one utterance a piece: losses within 7.7e-8, parameters within 7.0e-6 (a
# zero-initialised bias again; batches of one summing in yet another order).
LOSS_RTOL = 1e-6
PARAM_RTOL = 1e-5


@dataclass
class Fixed:
    """The same batches every epoch (a ``BatchPlan``)."""

    batches: list[list[int]]
    epoch: int = 0
    start: int = 0

    @property
    def per_rank(self) -> int:
        return len(self.batches)

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches[self.start:]

    def __len__(self) -> int:
        return self.per_rank - self.start


def plan(layout: str, seed: int, rank: int, world_size: int) -> Fixed:
    """``ddp``: each rank its part; ``union``: both parts as one batch; ``accum``: the parts
    as two batches (micro-batches of one step)."""
    if layout == "ddp":
        return Fixed([SPLIT[rank]])
    return Fixed([SPLIT[0] + SPLIT[1]] if layout == "union" else [*SPLIT])


def workload(layout: str, units: bool = True, depth: int = 1) -> Workload:
    """A conformer of ``depth`` blocks without dropout, SpecAugment or batch norm (whose
    statistics are per forward: two ranks' differ from their union's whatever the loss)."""
    torch.manual_seed(0)
    data = SyntheticUtterances(60, 7, asr.SAMPLE_RATE)
    model = ConformerCTC(len(data.vocabulary), dim=32, depth=depth, heads=2, dropout=0.0,
                         spec_augment=False)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                setattr(module, name, nn.Identity())
    return Workload(name="asr-units", model=model, train_dataset=data, loss_fn=asr.ctc_loss,
                    metrics={}, collate_fn=asr.collate_utterances,
                    # The union's: a pipeline runs the shape it traced.
                    example_batch=asr.collate_utterances([data[i] for i in SPLIT[0] + SPLIT[1]]),
                    batch_sampler=partial(plan, layout),
                    loss_units=asr.target_characters if units else None)


def run(layout: str, run_dir: Path, units: bool = True, depth: int = 1, **options: Any
        ) -> dict[str, Any]:
    """``STEPS`` steps of plain SGD; the loss curve and the final parameters."""
    config = TrainConfig(workload="asr-units", max_steps=STEPS, optimizer="sgd", lr=0.1,
                         schedule="constant", warmup_steps=0, eval_every=0, log_every=1,
                         progress=False, save_checkpoints=False, run_dir=str(run_dir),
                         **options)
    result = train(workload(layout, units, depth), config)
    params = {name: p.detach().clone() for name, p in result.model.named_parameters()}
    return {"losses": losses(run_dir), "params": params}


def _rank(rank: int, port: int, run_dir: str, layout: str, options: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from gpuflow.parallel.env import shutdown

    try:
        result = run(layout, Path(run_dir), nproc=2, **options)
        torch.save(result, Path(run_dir) / f"rank{rank}.pt")
    finally:
        shutdown()


def assert_same(measured: dict[str, Any], reference: dict[str, Any]) -> None:
    assert measured["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)
    for name, param in reference["params"].items():
        worst = (measured["params"][name] - param).abs().max().item()
        assert worst <= PARAM_RTOL * param.abs().max().item(), (name, worst)


@pytest.mark.filterwarnings("ignore:.*its FLOPs cannot be counted on fake tensors")
def test_ranks_with_unequal_characters_train_as_one_process_on_their_union(
        tmp_path: Path, one_torch_thread: None) -> None:
    union = run("union", tmp_path / "union")
    assert len(union["losses"]) == STEPS and union["losses"][1] < union["losses"][0]
    assert_same(run("accum", tmp_path / "accum", grad_accum=2), union)
    # Forked: the ranks inherit this process's imports (the FLOP count's fake tensors
    # import torch's compiler: seconds a rank).
    mp.start_processes(_rank, args=(free_port(), str(tmp_path / "ddp"), "ddp",
                                    {"strategy": "ddp"}), nprocs=2, start_method="fork")
    assert_same(torch.load(tmp_path / "ddp" / "rank0.pt"), union)
    # Unweighted, each micro-batch's mean counts alike: rank 0's 9 characters weigh as
    # much as rank 1's 78, and the run leaves the union's.
    unweighted = run("accum", tmp_path / "unweighted", units=False, grad_accum=2)
    assert unweighted["losses"][0] != pytest.approx(union["losses"][0], rel=1e-2)


@pytest.mark.filterwarnings("ignore:.*its FLOPs cannot be counted on fake tensors")
def test_pipeline_pieces_with_unequal_characters_train_as_one_process(
        tmp_path: Path, one_torch_thread: None) -> None:
    """Two stages of a two-block conformer, the union batch split into one utterance a
    pipeline micro-batch (9 to 30 characters): each piece's loss is weighed by its own
    characters, and the run is one process's on the union."""
    union = run("union", tmp_path / "union", depth=2)
    # Both stages read the replica's batch: both count it. The traced split would hand the
    # first stage lengths before waves, so the stages are cut by hand (with a warning).
    mp.start_processes(_rank, args=(free_port(), str(tmp_path / "pp"), "union",
                                    {"strategy": "pp", "microbatches": 4, "depth": 2}),
                       nprocs=2, start_method="fork")
    stages = [torch.load(tmp_path / "pp" / f"rank{rank}.pt") for rank in range(2)]
    # Each stage holds its blocks and a copy of the rest, which the step keeps identical.
    names = StageNames(canonical={}, manual=True)
    params = {names.original(name): p for stage in stages for name, p in stage["params"].items()}
    assert params.keys() == union["params"].keys()
    assert_same({"losses": stages[0]["losses"], "params": params}, union)
