"""Start N local worker processes, or join a multi-node job, through torch's elastic agent.

gpuflow never launches processes itself: torch.distributed.launcher's elastic_launch runs the
workers, restarts them on failure (``max_restarts``) and rendezvouses nodes over c10d.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from gpuflow.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, Preempted, UserError

# Besides torchelastic's own: Slurm's --signal=USR1@T is passed on to the workers too.
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# How long the signalled agent waits for its workers to write their checkpoint and exit
# before it SIGKILLs them: torch's own default (30 s) is shorter than a large save takes,
# and the scheduler's grace period, which ends the agent too, is the real bound.
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DEFAULT_SHUTDOWN_TIMEOUT_S = 300


@dataclass(frozen=True)
class LaunchSpec:
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    max_restarts: int = 0

    def validate(self) -> None:
        if self.nproc < 1 or self.nnodes < 1:
            raise UserError("--nproc and --nnodes must be at least 1.")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank must be in [0, {self.nnodes - 1}].")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UserError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT, the same on every node "
                "(e.g. node 0's address and a free port)."
            )
        if self.max_restarts < 0:
            raise UserError("--max-restarts must be 0 or more.")


def launch(spec: LaunchSpec, worker_argv: Sequence[str]) -> None:
    """Run ``python -m gpuflow.cli WORKER_ARGV`` on every local rank and wait for the job."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from gpuflow.parallel.env import free_port

    spec.validate()
    grace = shutdown_timeout()
    endpoint = spec.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    rdzv_configs: dict[str, object] = {"timeout": 300}
    if spec.nnodes > 1:
        rdzv_configs["is_host"] = spec.node_rank == 0
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        run_id=_default_run_id(spec, endpoint),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=spec.max_restarts,
        monitor_interval=0.5,
        signals_to_handle=AGENT_SIGNALS,
        shutdown_timeout=grace,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "gpuflow.cli", *worker_argv)
    except SignalException as exc:
        # The agent passed the signal on and waited (up to ``grace``) for the workers to
        # save their checkpoint and exit.
        raise Preempted(f"the job got {exc.sigval.name} and passed it to its workers; their "
                        "lines above say where they stopped (none with "
                        "--no-save-on-signal).") from None
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        if first.exitcode == EXIT_PREEMPTED:
            raise Preempted(f"rank {rank} stopped for a preemption (above).") from None
        if first.exitcode == EXIT_USER_ERROR:
            raise UserError(f"rank {rank} stopped on the error above.") from None
        others = sorted(set(exc.failures) - {rank})
        stopped = f"; rank(s) {', '.join(map(str, others))} were stopped after it" if others else ""
        raise WorkerFailedError(
            f"Distributed job failed: rank {rank} exited with code {first.exitcode}"
            f"{_signal_name(first.exitcode)} first{stopped}. Its own error, if it printed one, "
            "is above."
        ) from None


def shutdown_timeout() -> int:
    """Seconds the agent gives signalled workers: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, torchrun's
    own setting, or gpuflow's default."""
    raw = os.environ.get(SHUTDOWN_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_SHUTDOWN_TIMEOUT_S
    if not raw.strip().isdigit():
        raise UserError(f"{SHUTDOWN_TIMEOUT_ENV}={raw!r} is not a whole number of seconds: "
                        "it is how long the launcher lets signalled workers save a checkpoint "
                        f"before SIGKILL. Set it to 0 or more, or unset it for "
                        f"{DEFAULT_SHUTDOWN_TIMEOUT_S} s.")
    return int(raw)


def _default_run_id(spec: LaunchSpec, endpoint: str) -> str:
    """Every node's launcher must name the same job: derive it from the shared endpoint."""
    if spec.nnodes == 1:
        return f"gpuflow-{uuid.uuid4().hex[:8]}"
    return "gpuflow-" + hashlib.sha256(endpoint.encode()).hexdigest()[:12]


def _signal_name(exitcode: int) -> str:
    if exitcode >= 0:
        return ""
    try:
        return f" (killed by {signal.Signals(-exitcode).name})"
    except ValueError:
        return ""


class WorkerFailedError(RuntimeError):
    """A worker process of a launched job failed; the message names its rank."""
