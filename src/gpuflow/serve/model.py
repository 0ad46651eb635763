"""Load a trained model for inference from a run dir or an exported safetensors file.

Both carry the run's configuration as JSON (``config.json``, or the export's metadata): the
workload's factory rebuilds the network from it and the weights are loaded by name; and
the state its codec saved at training time (``serving.json``, or the export's metadata).
Nothing is unpickled. The run dir is read through its documented format (docs/run-dir.md), so
serving depends on the format, not on the training code.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.utils._pytree import tree_map_only

from gpuflow import checkpoint as ckpt
from gpuflow.config import TrainConfig
from gpuflow.devices import resolve_device
from gpuflow.errors import UserError
from gpuflow.precision import PrecisionPolicy, make_policy
from gpuflow.serving import SERVING_FILE
from gpuflow.workload import BUILTIN_WORKLOADS, Workload, call_model, resolve_workload


@dataclass
class LoadedModel:
    """A workload's model with trained weights, in eval mode, and where it came from."""

    workload: Workload
    config: dict[str, Any]
    step: int
    source: Path
    serving_state: dict[str, Any] | None = None

    @property
    def model(self) -> nn.Module:
        return self.workload.model


def newest_run_weights(run_dir: Path) -> tuple[dict[str, torch.Tensor], int]:
    """Weights of the newest checkpoint whose checksums verify.

    A distributed run's checkpoints are sharded, and assembling them means unpickling
    torch.distributed.checkpoint metadata, which the server never does: it asks for an
    export instead.
    """
    checkpoint = ckpt.latest_verified(run_dir / "checkpoints")
    if checkpoint is None:
        raise UserError(f"{run_dir} has no valid checkpoint; train it first.")
    if ckpt.is_sharded(checkpoint):
        raise UserError(
            f"{checkpoint.path} is sharded (saved by a distributed run). Write one file "
            f"first with `gpuflow export {run_dir} --out model.safetensors`, then serve that."
        )
    return load_file(str(checkpoint.path / ckpt.MODEL_FILE)), checkpoint.step


def check_source(path: Path) -> None:
    """Fail early, without reading weights, on a path that cannot hold a model."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is not a gpuflow run dir (no config.json).")
    elif path.suffix != ".safetensors" or not path.is_file():
        raise UserError(f"{path} is neither a gpuflow run dir nor a .safetensors export.")


Source = tuple[dict[str, Any], dict[str, torch.Tensor], int, dict[str, Any] | None]


def read_source(path: Path) -> Source:
    """(run config, weights, step, codec state or None) from a run dir or a ``gpuflow
    export`` file; runs saved before the codec state was saved have none."""
    check_source(path)
    if path.is_dir():
        weights, step = newest_run_weights(path)
        saved = path / SERVING_FILE
        serving = json.loads(saved.read_text()) if saved.is_file() else None
        return json.loads((path / "config.json").read_text()), weights, step, serving
    try:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise UserError(f"{path} is not a readable safetensors file ({exc}).") from None
    if "config" not in metadata:
        raise UserError(f"{path} has no gpuflow config in its metadata; export it with "
                        "`gpuflow export RUN_DIR --out FILE.safetensors`.")
    serving = json.loads(metadata["serving"]) if "serving" in metadata else None
    return (json.loads(metadata["config"]), load_file(str(path)), int(metadata.get("step", 0)),
            serving)


def build_workload(config: dict[str, Any], workload: str | None = None) -> Workload:
    """The run's workload, rebuilt with the options it was trained with.

    A built-in workload whose training data is not on this machine is rebuilt from its
    synthetic data instead: the network's shape depends on the options, not the data.
    """
    known = {f.name for f in fields(TrainConfig)} - {"extra"}
    train_config = TrainConfig(**{k: v for k, v in config.items() if k in known})
    spec = workload or train_config.workload
    options = train_config.workload_options()
    try:
        return resolve_workload(spec, options)
    except UserError:
        if spec not in BUILTIN_WORKLOADS or options.get("data") == "synthetic":
            raise
        return resolve_workload(spec, {**options, "data": "synthetic"})


def restore_workload(config: dict[str, Any], weights: dict[str, torch.Tensor], source: Path,
                     workload: str | None = None) -> Workload:
    """The run's workload rebuilt, its model holding ``weights``, in eval mode."""
    built = build_workload(config, workload)
    try:
        built.model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise UserError(f"The weights in {source} do not fit workload "
                        f"{workload or config.get('workload')!r}: {exc}") from None
    built.model.eval()
    return built


def load_model(path: str | Path, workload: str | None = None) -> LoadedModel:
    """Rebuild the run's model and load its weights; ``workload`` overrides the saved one."""
    source = Path(path)
    config, weights, step, serving = read_source(source)
    return LoadedModel(restore_workload(config, weights, source, workload), config, step,
                       source, serving)


def batch_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes a static-shape model is compiled for: powers of two, then the maximum
    (the predict path's batches and the generation engine's decode steps)."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


class Runner:
    """Calls the model on a device, in a precision, under ``torch.inference_mode``.

    ``compile`` uses ``torch.compile``; on CUDA with ``cuda_graphs`` it compiles with
    ``mode="reduce-overhead"``, which captures a CUDA graph per input shape, so the fixed
    batch buckets replay as graphs. On a CPU there are no CUDA graphs and the model runs
    without them (``describe()`` says so).
    """

    def __init__(self, model: nn.Module, device: str = "auto", precision: str = "fp32",
                 compile: bool = False, cuda_graphs: bool = False) -> None:
        self.device = resolve_device(device)
        self.policy: PrecisionPolicy = make_policy(precision, self.device)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.notes: list[str] = []
        if cuda_graphs and not self.cuda_graphs:
            self.notes.append("CUDA graphs need a CUDA device; running without them")
        if self.device.type == "cpu" and precision == "fp16":
            self.notes.append("fp16 autocast on a CPU without native fp16 is slower than fp32")
        model = model.to(self.device)
        self.compiled = compile or self.cuda_graphs
        if self.compiled:
            mode = "reduce-overhead" if self.cuda_graphs else None
            model = torch.compile(model, mode=mode, dynamic=False)  # type: ignore[assignment]
        self.model = model

    @property
    def static_shapes(self) -> bool:
        """Compiled models and graphs want few distinct shapes: pad batches to buckets."""
        return self.compiled

    def describe(self) -> str:
        """What actually runs, e.g. ``cpu, bf16 autocast over fp32 weights, compiled``."""
        dtype = self.policy.autocast_dtype
        text = f"{self.device}, " + ("fp32" if dtype is None
                                      else f"{self.policy.name} autocast over fp32 weights")
        if self.compiled:
            text += ", compiled" + (" with CUDA graphs" if self.cuda_graphs else "")
        return "; ".join([text, *self.notes])

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        with torch.inference_mode(), self.policy.autocast():
            yield

    def call(self, inputs: Any) -> Any:
        """The model's outputs for a batch's inputs (a tensor, a tuple or a dict of
        tensors), floating-point tensors in fp32."""
        moved = tree_map_only(torch.Tensor, lambda t: t.to(self.device, non_blocking=True),
                              inputs)
        with self.context():
            outputs = call_model(self.model, moved)
        return tree_map_only(torch.Tensor,
                             lambda t: t.float() if t.is_floating_point() else t, outputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.call(inputs if len(inputs) > 1 else inputs[0])
