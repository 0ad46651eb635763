"""Exposed communication: collectives that hold the host are timed as the step's comm, each
wait once, inside a step only; FSDP's waits on one rank and DTensor's on two."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, cli_env

from gpuflow.parallel.env import free_port


def test_blocking_collectives_count_as_comm_only_inside_a_timed_step() -> None:
    from gpuflow.telemetry.steps import StepTimer

    timer = StepTimer(torch.device("cpu"))
    with timer.exposed_comm():  # e.g. an evaluation forward's all-gather: not a step's
        time.sleep(0.3)
    timer.window.steps = 1
    timer.compute.begin()
    with timer.exposed_comm():
        time.sleep(0.3)
    time.sleep(0.02)
    timer.compute.end()
    window = timer.close_window()
    # Bounds a slow machine cannot break: each would fail by a whole 0.3 s sleep.
    assert 0.3 <= window["comm_s"] < 0.6  # the step's collective, not the other one
    assert 0.02 <= window["compute_s"] < 0.3  # forward+backward without the collective
    assert window["compute_s"] + window["comm_s"] <= window["step_time_s"]


def test_fsdp_waits_are_timed_each_once_during_a_step_then_restored() -> None:
    """On CUDA FSDP's exposed communication is the compute stream's time in its waiting
    methods. The same methods run on the CPU, where the patching and the rule that a wait
    inside another counts once are checked."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from gpuflow.parallel.sharded import apply_fsdp
    from gpuflow.telemetry.steps import StepTimer
    from gpuflow.telemetry.waits import TimedWaits, fsdp_waits, timeable

    assert timeable(fsdp_waits())

    untimed = FSDPParamGroup.post_backward
    timer = StepTimer(torch.device("cpu"))
    nested: list[bool] = []

    @contextlib.contextmanager
    def timed():
        nested.append(timer.comm.running)
        with timer.exposed_comm():
            time.sleep(0.2 if nested[-1] else 0.01)
            yield

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                    torch.nn.ReLU(), torch.nn.Linear(8, 1))
        apply_fsdp(model, [model[0], model[2]], None, reshard_after_forward=True)
        waits = TimedWaits(fsdp_waits(), timed)
        timer.window.steps = 1
        timer.compute.begin()
        with waits:
            assert FSDPParamGroup.post_backward is not untimed
            model(torch.randn(4, 8)).sum().backward()
        timer.compute.end()
    finally:
        dist.destroy_process_group()
    assert FSDPParamGroup.post_backward is untimed
    # Three units (two blocks and the root, which owns the last layer): a wait before each
    # runs forward and again before its backward, the second block's post-backward, and the
    # end-of-backward callback, which runs the post-backward of the root and of the first
    # block itself (their inputs need no gradient, so autograd does not): those two nest.
    assert nested.count(False) >= 3 + 3 + 1 + 1
    assert nested.count(True) == 2
    window = timer.close_window()
    # Outermost waits slept 10 ms each, nested ones 200 ms inside them: counted twice, these
    # would add another 0.4 s, more than this tiny model's own work in the waits.
    least = 0.01 * nested.count(False) + 0.2 * nested.count(True)
    assert least <= window["comm_s"] < least + 0.3


TP_WAITS_SCRIPT = """
import contextlib, json, os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from gpuflow.models.gpt import GPT, GPTConfig
from gpuflow.parallel.tensor import apply_tensor_parallel, transformer_plan
from gpuflow.telemetry.waits import TimedWaits, functional_collective_waits

dist.init_process_group("gloo")
torch.manual_seed(0)
model = GPT(GPTConfig(layers=3, dim=32, heads=2, seq_len=8))
apply_tensor_parallel(list(model.blocks), transformer_plan(), init_device_mesh("cpu", (2,)))
phase, waits = ["forward"], {"forward": 0, "backward": 0}

@contextlib.contextmanager
def counted():
    waits[phase[0]] += 1
    yield

with TimedWaits(functional_collective_waits(), counted):
    loss = model(torch.randint(0, 256, (2, 8))).float().sum()
    phase[0] = "backward"
    loss.backward()
if dist.get_rank() == 0:
    print(json.dumps(waits), flush=True)
dist.destroy_process_group()
# A gloo worker drops a finished collective on its own thread. One launched in backward keeps
# autograd's stashed Python context (torch 2.13), so if that drop comes after the interpreter
# began finalizing (this script ends right after backward; a busy machine delays the worker),
# taking the GIL kills the thread and aborts the process. Leave without finalizing.
os._exit(0)
"""


@pytest.mark.slow
def test_tensor_parallel_waits_are_timed_in_forward_and_backward(tmp_path: Path) -> None:
    """Each block all-reduces the output of its two row-wise layers in forward and the input
    gradient of its two column-wise layers in backward; every one of those waits is timed."""
    script = tmp_path / "tp_waits.py"
    script.write_text(TP_WAITS_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(script)],
        capture_output=True, text=True, timeout=180, env=cli_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"forward": 6, "backward": 6}
