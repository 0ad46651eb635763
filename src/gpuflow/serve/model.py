"""Load a model for inference from a run dir, an exported safetensors file, a Hugging Face
export directory, or any Hugging Face causal-LM directory.

Each carries the run's configuration as JSON (``config.json``, the export's metadata, or
``gpuflow_run.json`` beside a Hugging Face export): the workload's factory rebuilds the
network from it and the weights are loaded by name (for a Hugging Face export, by
``transformers``' ``from_pretrained``); and the state its codec saved at training time
(``serving.json``, or the export's metadata or run record). Nothing is unpickled. The run
dir is read through its documented format (docs/run-dir.md), so serving depends on the
format, not on the training code. A Hugging Face directory gpuflow did not write is read
as the Hub lays it out (``gpuflow.model_dir``) and served under its own tokenizer.
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
from gpuflow.graph_threads import prepare_thread_for_cuda_graphs
from gpuflow.hf import is_hf_model
from gpuflow.model_dir import TOKENIZER_FILES, ModelDirectory, is_model_directory
from gpuflow.precision import PrecisionPolicy, make_policy
from gpuflow.serve.dtypes import short_name, weights_dtype
from gpuflow.serve.quantize import Quantized, quantize_weights
from gpuflow.serving import RUN_CONFIG_FILE, SERVING_FILE
from gpuflow.workload import Workload, call_model, is_builtin, resolve_workload


@dataclass
class LoadedModel:
    """A workload's model with trained weights, in eval mode, and where it came from."""

    workload: Workload
    config: dict[str, Any]
    step: int
    source: Path
    serving_state: dict[str, Any] | None = None
    directory: ModelDirectory | None = None  # where its tokenizer and generation config are

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


def is_hf_export(path: Path) -> bool:
    """A ``gpuflow export --format hf`` directory: its ``config.json`` is Hugging Face's,
    and the run's own configuration is in ``RUN_CONFIG_FILE``."""
    return path.is_dir() and (path / RUN_CONFIG_FILE).is_file()


def check_source(path: Path) -> None:
    """Fail early, without reading weights, on a path that cannot hold a model."""
    if is_hf_export(path):
        return
    if path.is_dir():
        if is_model_directory(path):
            ModelDirectory.check(path)
            return
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is not a gpuflow run dir (no config.json) nor a "
                            "Hugging Face model directory (no config.json naming a "
                            "model_type).")
    elif path.suffix != ".safetensors" or not path.is_file():
        raise UserError(f"{path} is neither a gpuflow run dir, a Hugging Face export dir "
                        "nor a .safetensors export.")


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


def build_workload(config: dict[str, Any], workload: str | None = None,
                   serving: dict[str, Any] | None = None) -> Workload:
    """The run's workload, rebuilt with the options it was trained with, and its codec's
    saved state (``serving``) for a factory that sizes its model from that.

    A built-in workload whose training data is not on this machine is rebuilt from its
    synthetic data instead: the network's shape depends on the options, not the data.
    """
    known = {f.name for f in fields(TrainConfig)} - {"extra"}
    train_config = TrainConfig(**{k: v for k, v in config.items() if k in known})
    spec = workload or train_config.workload
    options = train_config.workload_options()
    state = (serving or {}).get("spec")
    try:
        return resolve_workload(spec, options, state)
    except UserError:
        if not is_builtin(spec) or options.get("data") == "synthetic":
            raise
        return resolve_workload(spec, {**options, "data": "synthetic"}, state)


def restore_workload(config: dict[str, Any], weights: dict[str, torch.Tensor], source: Path,
                     workload: str | None = None,
                     serving: dict[str, Any] | None = None) -> Workload:
    """The run's workload rebuilt, its model holding ``weights``, in eval mode."""
    built = build_workload(config, workload, serving)
    try:
        built.model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise UserError(f"The weights in {source} do not fit workload "
                        f"{workload or config.get('workload')!r}: {exc}") from None
    built.model.eval()
    return built


def read_run_record(path: Path) -> tuple[dict[str, Any], int, dict[str, Any] | None]:
    """(run config, step, codec state or None) from a Hugging Face export's
    ``RUN_CONFIG_FILE``; exports written before it held the codec state have none."""
    record_path = path / RUN_CONFIG_FILE
    try:
        record = json.loads(record_path.read_text())
        config, step, serving = record["config"], int(record["step"]), record.get("serving")
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{record_path} is not the run record `gpuflow export --format hf` "
                        f"writes ({type(exc).__name__}: {exc}); export the run again.") from None
    return config, step, serving


def _exported_class(path: Path) -> type:
    """The ``transformers`` class a conversion's ``config.json`` names (``architectures``)."""
    import transformers

    try:
        names = transformers.AutoConfig.from_pretrained(path, local_files_only=True).architectures
    except (OSError, ValueError) as exc:
        raise UserError(f"{path / 'config.json'} is not a Hugging Face config transformers "
                        f"reads ({exc}); export the run again.") from None
    found = getattr(transformers, (names or [""])[0], None)
    if not isinstance(found, type):
        raise UserError(f"{path / 'config.json'} names no transformers model class in "
                        f"'architectures' (it has {names!r}); export the run again.")
    return found


def open_hf_export(path: Path, built: Workload) -> nn.Module:
    """The model a Hugging Face export holds, in the rebuilt model's dtype, opened by
    ``transformers``' ``from_pretrained``, which reads sharded weights and ties what the
    model ties; any weight missing, unexpected or misshapen is an error.

    A Hugging Face workload's export is its model's ``save_pretrained``: it is reopened as
    the rebuilt model's class and config, so it must fit the workload. Any other workload's
    export is its own conversion (``Workload.export_hf``; textlm's is a ``GPT2LMHeadModel``),
    opened as the class its ``config.json`` names and served in place of the workload's
    model: the conversion is exact (the same logits within fp32 rounding, the same greedy
    generations; tests/test_export.py), the workload's codec reads its ``.logits``, and the
    generation engine drives it through its Hugging Face path. Mapping the names back
    instead would need an inverse of every workload's converter.
    """
    own = is_hf_model(built.model)
    cls = type(built.model) if own else _exported_class(path)
    options = {"config": built.model.config} if own else {}
    try:
        model, info = cls.from_pretrained(  # type: ignore[attr-defined]
            path, dtype=next(built.model.parameters()).dtype, local_files_only=True,
            use_safetensors=True, ignore_mismatched_sizes=True, output_loading_info=True,
            **options)
    except Exception as exc:  # OSError for a missing file, safetensors' own for a corrupt one
        raise UserError(f"The weights in {path} cannot be loaded ({type(exc).__name__}: "
                        f"{exc}); export the run again with `gpuflow export RUN_DIR --format "
                        "hf --out DIR`.") from None
    _check_loaded(path, built.name, info)
    return model.eval()


def _check_loaded(path: Path, workload: str, info: dict[str, Any]) -> None:
    """Refuse a load that left weights missing, unexpected or misshapen, naming a few."""
    def named(entry: Any) -> str:  # a name, or (name, shape in the export, in the model)
        if isinstance(entry, tuple):
            name, ours, theirs = entry
            return f"{name} {list(ours)} in the export, {list(theirs)} in the model"
        return str(entry)

    wrong = {kind: sorted(map(named, info[key])) for kind, key in (
        ("missing", "missing_keys"), ("unexpected", "unexpected_keys"),
        ("of another shape", "mismatched_keys")) if info.get(key)}
    if wrong:
        found = "; ".join(f"{kind}: {', '.join(names[:3])}" + (", ..." if len(names) > 3 else "")
                          for kind, names in wrong.items())
        raise UserError(f"The weights in {path} do not fit workload {workload!r} ({found}); "
                        "export the run again, or pass the --workload it was trained with.")


def load_hf_export(path: Path, workload: str | None = None) -> LoadedModel:
    """The run's workload rebuilt from the export's run record, serving the export's model
    (under the tokenizer the export carries, when it carries one)."""
    config, step, serving = read_run_record(path)
    built = build_workload(config, workload, serving)
    built.model = open_hf_export(path, built)
    tokenized = any((path / name).is_file() for name in TOKENIZER_FILES)
    return LoadedModel(built, config, step, path, serving,
                       ModelDirectory.check(path) if tokenized else None)


def load_model_directory(path: Path, name: str | None = None,
                         max_model_len: int | None = None) -> LoadedModel:
    """A Hugging Face causal-LM directory gpuflow did not write, served as a workload named
    ``name`` (default: the path) whose predict inputs are token ids of any length up to
    its context (or ``max_model_len``)."""
    directory = ModelDirectory.check(path)
    ids = torch.zeros(1, 16, dtype=torch.long)
    workload = Workload(name=name or str(path), model=directory.load_model(), train_dataset=[],
                        example_batch=({"input_ids": ids}, ids),
                        max_sequence_length=directory.context_length(max_model_len))
    return LoadedModel(workload, directory.config, 0, path, None, directory)


def load_model(path: str | Path, workload: str | None = None, name: str | None = None,
               max_model_len: int | None = None) -> LoadedModel:
    """Rebuild the run's model and load its weights; ``workload`` overrides the saved one.
    ``name``: what a Hugging Face directory gpuflow did not write is served as;
    ``max_model_len`` caps the sequences it takes."""
    source = Path(path)
    if is_hf_export(source):
        return load_hf_export(source, workload)
    if is_model_directory(source):
        return load_model_directory(source, name, max_model_len)
    config, weights, step, serving = read_source(source)
    return LoadedModel(restore_workload(config, weights, source, workload, serving), config,
                       step, source, serving)


def batch_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes a static-shape model is compiled for: powers of two, then the maximum
    (the predict path's batches and the generation engine's decode steps)."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


def allow_compiled_shapes(count: int) -> None:
    """Let torch.compile keep ``count`` graphs of one function, one per warmed-up shape:
    past dynamo's recompile limit (8 by default) it runs the function eagerly for every
    shape not yet compiled, saying so once in a warning."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < count:
        setattr(config, name, count)


class Runner:
    """Calls the model on a device, in a precision, under ``torch.inference_mode``.

    ``quantize`` (``"int8"``) quantizes the linear weights on the device, before any
    compile (``gpuflow.serve.quantize``). ``compile`` uses ``torch.compile``; on CUDA with
    ``cuda_graphs`` it compiles with ``mode="reduce-overhead"``, which captures a CUDA graph
    per input shape, so the fixed batch buckets replay as graphs. On a CPU there are no CUDA
    graphs and the model runs without them (``describe()`` says so).
    """

    def __init__(self, model: nn.Module, device: str = "auto", precision: str = "fp32",
                 compile: bool = False, cuda_graphs: bool = False,
                 quantize: str | None = None, dtype: str = "auto") -> None:
        self.device = resolve_device(device)
        self.policy: PrecisionPolicy = make_policy(precision, self.device)
        self.dtype = weights_dtype(dtype, self.device, precision, model)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.notes: list[str] = []
        if cuda_graphs and not self.cuda_graphs:
            self.notes.append("CUDA graphs need a CUDA device; running without them")
        if self.device.type == "cpu" and precision == "fp16":
            self.notes.append("fp16 autocast on a CPU without native fp16 is slower than fp32")
        model = model.to(self.device, self.dtype)
        self.quantized: Quantized | None = quantize_weights(model, quantize) if quantize else None
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
        weights = short_name(self.dtype)
        text = f"{self.device}, " + (f"{self.policy.name} autocast over fp32 weights"
                                      if self.autocast else weights if weights == "fp32"
                                      else f"{weights} weights")
        if self.quantized is not None:
            text += f", {self.quantized.describe()}"
        if self.compiled:
            text += ", compiled" + (" with CUDA graphs" if self.cuda_graphs else "")
        return "; ".join([text, *self.notes])

    @property
    def autocast(self) -> bool:
        """Whether ``--precision`` autocasts: over fp32 weights only (weights held in a
        reduced dtype compute in it)."""
        return self.policy.autocast_dtype is not None and self.dtype == torch.float32

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        with torch.inference_mode(), (self.policy.autocast() if self.autocast
                                      else contextlib.nullcontext()):
            yield

    def call(self, inputs: Any) -> Any:
        """The model's outputs for a batch's inputs (a tensor, a tuple or a dict of
        tensors), floating-point tensors in fp32."""
        if self.cuda_graphs:  # the batcher's thread, or the event loop's for a lone request
            prepare_thread_for_cuda_graphs()
        moved = tree_map_only(torch.Tensor, self._moved, inputs)
        with self.context():
            outputs = call_model(self.model, moved)
        return tree_map_only(torch.Tensor,
                             lambda t: t.float() if t.is_floating_point() else t, outputs)

    def _moved(self, tensor: torch.Tensor) -> torch.Tensor:
        """An input on the device; a floating one in the weights' dtype, unless autocast
        takes it as it is."""
        if tensor.is_floating_point() and not self.autocast:
            return tensor.to(self.device, self.dtype, non_blocking=True)
        return tensor.to(self.device, non_blocking=True)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.call(inputs if len(inputs) > 1 else inputs[0])
