"""Shared fixtures: an isolated peak-probe cache and helpers to run the CLI in a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import httpx
    import torch
    from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "plugins"
sys.path.insert(0, str(PLUGINS))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["GPUFLOW_CACHE_DIR"] = str(tmp_path_factory.mktemp("gpuflow-cache"))


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def sigkill_at_gate(process: subprocess.Popen[str], gate: Path, timeout: float = 120) -> None:
    """SIGKILL ``process``, as a crash would, once ``gate`` exists: a run whose data blocks
    once that checkpoint is written is then stopped at a known point after it."""
    deadline = time.monotonic() + timeout
    while not gate.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)
    assert process.poll() is None, process.stderr.read() if process.stderr else ""
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `gpuflow ARGS` as a user would, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "gpuflow.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=env or cli_env(), cwd=cwd or ROOT,
    )


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """For a module of tiny models (``pytestmark = pytest.mark.usefixtures(...)``)."""
    from hub_models import one_thread

    with one_thread():
        yield


@asynccontextmanager
async def serving(app: FastAPI, ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """Serve ``app`` with uvicorn on a socket bound before the server starts (so no polling
    for the port), in this event loop; optionally wait until the model is warmed up."""
    import httpx
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}",
                                     timeout=30) as client:
            if ready:
                await asyncio.wait_for(app.state.serve.ready.wait(), 60)
            yield client
    finally:
        server.should_exit = True
        await task
        sock.close()


def api_error(reply: httpx.Response, status: int) -> dict[str, Any]:
    """The error of ``reply``, checked to be OpenAI's envelope with ``status``."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert {"message", "type", "param", "code"} <= error.keys(), error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status in (400, 404, 405, 413, 415, 422)
                             else "authentication_error" if status == 401 else "server_error")
    assert error["param"] is None or isinstance(error["param"], str)
    return error


async def eventually(condition: Callable[[], bool], timeout: float = 10) -> None:
    """Wait for a state the server reaches on its own (e.g. a queue depth)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


if TYPE_CHECKING:
    from hub_models import HubModels


@pytest.fixture(scope="session")
def hub_models(tmp_path_factory: pytest.TempPathFactory) -> HubModels:
    """Hugging Face Hub-style model directories by kind (``hub_models.KINDS``: llama,
    llama-sharded, qwen2, mistral, gpt2), a mapping that builds each on first use, once
    per session."""
    from hub_models import HubModels

    return HubModels(tmp_path_factory.mktemp("hub-models"))


TEXTLM_SIZE = "layers=2,dim=32,heads=4,seq=64"


def train_refusal(run_dir: Path, *flags: str) -> str:
    """What `gpuflow train` (in this process: one step of a synthetic textlm on the CPU)
    says when it refuses ``flags``, having exited with code 2."""
    from gpuflow.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["train", "--workload", "textlm", "--data", "synthetic", "--device",
                         "cpu", "--max-steps", "1", "--no-progress", "--run-dir",
                         str(run_dir), *flags])
        except SystemExit as exc:  # argparse's own refusal of an unknown choice
            code = exc.code
    assert code == 2, err.getvalue()
    return err.getvalue()


@pytest.fixture(scope="session")
def textlm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A textlm GPT (``TEXTLM_SIZE``) trained 3 steps, once per session: its run dir and
    the trained model, for the tests that serve it."""
    from gpuflow import TrainConfig, train
    from gpuflow.workloads import textlm

    run_dir = tmp_path_factory.mktemp("generate") / "textlm"
    result = train(textlm.build(model_size=TEXTLM_SIZE),
                   TrainConfig(max_steps=3, batch_size=8, progress=False, eval_every=0,
                               run_dir=str(run_dir), workload="textlm", model_size=TEXTLM_SIZE))
    return run_dir, result.model.eval()


@pytest.fixture(scope="session")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """The Hugging Face GPT-2 workload (user_workloads.hf_models:gpt2) trained 2 steps, once
    per session: its run dir and the trained model."""
    from user_workloads import hf_models

    from gpuflow import TrainConfig, train

    run_dir = tmp_path_factory.mktemp("generate-hf") / "gpt2"
    result = train(hf_models.gpt2(),
                   TrainConfig(max_steps=2, batch_size=8, progress=False, eval_every=0,
                               run_dir=str(run_dir), workload="user_workloads.hf_models:gpt2"))
    return run_dir, result.model.eval()


@pytest.fixture(scope="session")
def short_digits_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """digits trained 12 steps by the CLI, as a user would (windows of 3 steps, evaluations
    at 6 and 12, one checkpoint at the end), once per session: its run dir and what
    `gpuflow train` printed. The serving and report tests read it; none writes into it
    but the report's page."""
    run_dir = tmp_path_factory.mktemp("digits") / "digits-run"
    result = run_cli("train", "--workload", "digits", "--max-steps", "12", "--log-every", "3",
                     "--eval-every", "6", "--no-progress", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir, result.stdout


@pytest.fixture(scope="session")
def small_fsdd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic clips in the FSDD layout: 10 digits x 2 speakers x 7 takes."""
    from speech_clips import synthesise_fsdd

    return synthesise_fsdd(tmp_path_factory.mktemp("fsdd") / "recordings", speakers=2, takes=7)


@pytest.fixture(scope="session")
def packed_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Digits packed in small shards (``packed_sets.pack_small_digits``: 9 train shards),
    once per session, for the packing and streaming tests; none writes into it."""
    from packed_sets import pack_small_digits

    return pack_small_digits(tmp_path_factory.mktemp("packed"))
