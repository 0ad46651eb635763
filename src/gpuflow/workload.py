"""The plug-in contract: what a user's code hands gpuflow, and how it is found and checked."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from gpuflow import hf
from gpuflow.data.iterable import is_sized, is_stream, peek
from gpuflow.data.sampler import BatchPlan
from gpuflow.errors import UserError
from gpuflow.input_schema import InputSchema, mask_keywords, sequence_schema
from gpuflow.serving import Codec, ServingSpec, TensorCodec

Batch = tuple[Any, torch.Tensor]
MetricFn = Callable[[Any, torch.Tensor], Any]  # a tensor, a number or a Ratio
IGNORE_INDEX = -100  # targets equal to it count in neither the default loss nor accuracy


class Ratio(NamedTuple):
    """A metric's value as parts summed over an evaluation before they are divided."""

    numerator: float
    denominator: float


def call_model(model: nn.Module, inputs: Any) -> Any:
    """Call ``model`` on a batch's inputs: a tensor, a tuple or list (positional) or any
    mapping (keyword arguments). The one rule for training (through the strategy's
    ``ModelParts``) and serving."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


def model_logits(outputs: Any) -> torch.Tensor:
    """The logits in what a model returned: a tensor, ``.logits`` (a Hugging Face
    ``ModelOutput``, or a dict's ``"logits"``), or the first element of a tuple."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), torch.Tensor):
        return outputs["logits"]
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(outputs, tuple | list) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise UserError(
        f"The default loss and metrics read logits from the model's output, and it returned "
        f"a {type(outputs).__name__} without any: return a tensor, a tuple whose first element "
        "is the logits, or an object with .logits, or give the Workload a loss_fn and "
        "metrics that read what the model returns."
    )


def _aligned(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence logits ``[B, T, V]`` against ``[B, T]`` targets as ``B*T`` rows; other
    shapes as they are (``[B, C, ...]`` against ``[B, ...]`` is PyTorch's own layout)."""
    if logits.ndim == 3 and target.ndim == 2 and logits.shape[:2] == target.shape:
        return logits.flatten(0, 1), target.flatten()
    return logits, target


def accuracy(outputs: Any, target: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy of the logits over their last dimension, ignoring ``IGNORE_INDEX``."""
    logits, target = _aligned(model_logits(outputs), target)
    counted = target != IGNORE_INDEX
    return (logits.argmax(dim=-1) == target)[counted].float().mean()


def cross_entropy(outputs: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 whatever the autocast dtype of the logits.

    A model that computed its own loss (a Hugging Face model given ``labels``) returns it
    as ``.loss``, and that loss is used; otherwise it is computed from the logits, per
    position for sequence logits, with targets equal to ``IGNORE_INDEX`` left out.
    """
    own = None if isinstance(outputs, torch.Tensor) else getattr(outputs, "loss", None)
    if isinstance(own, torch.Tensor):
        return own.float()
    logits, target = _aligned(model_logits(outputs), target)
    return nn.functional.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX)


@dataclass
class Workload:
    """A model, its data and its objective.

    Datasets yield ``(inputs, target)`` pairs. ``inputs`` is a tensor, a tuple of tensors
    (passed to the model positionally) or a mapping of tensors (passed as keyword arguments:
    a dict, or a ``UserDict`` such as transformers' ``BatchEncoding``), in training and in
    serving alike (:func:`call_model`).
    ``repeated_blocks`` names the modules activation checkpointing wraps and FSDP shards;
    ``tensor_parallel_plan`` maps module names relative to each block to DTensor parallel
    styles (``ColwiseParallel``/``RowwiseParallel``) for ``--strategy tp``. A Hugging Face
    model needs neither: its layers and its own plan are found (``gpuflow.hf``).
    ``export_hf`` writes the trained model in the Hugging Face format for ``gpuflow export
    --format hf`` (a Hugging Face model needs none: it saves itself). ``serving`` declares
    how requests become inputs and outputs answers (``gpuflow.serving``); without it any
    model is served from tensors shaped like its example batch. ``augment(item, rng)``
    transforms a training item with a numpy generator seeded by (seed, epoch, index), so
    augmented runs resume exactly (``gpuflow.data.augment``); evaluation is never augmented.
    ``default_epochs`` is the run's length when neither ``--epochs`` nor ``--max-steps``
    is given (None: the trainer's default of 10); ``default_ema_decay`` the decay of the
    weight average when ``--ema-decay`` is not given (None: no average,
    ``gpuflow.train.averaging``). ``max_sequence_length`` is the longest sequence the model
    takes when its inputs' first per-sample dimension is a sequence; serving takes any length
    up to it (None: a Hugging Face model's config gives it, any other model takes its example
    batch's shapes).
    ``batch_sampler(seed, rank, world_size)`` forms the training batches itself, e.g. by
    duration (``gpuflow.data.duration_buckets``): batches of varying size, each rank as many,
    resumable by ``set_position(epoch, batch)``; ``--batch-size`` then sizes evaluation only.
    ``padding(inputs)`` gives a batch's real and padded element counts (a tensor or number,
    and an int), so that metrics.jsonl logs the padded share of each step (``padding_frac``).
    A metric may return a ``Ratio``: evaluation sums its parts over the batches and divides
    once (word error rate: errors over reference words, not a mean of per-batch rates).
    ``data_report()`` says what the loader met in the data, e.g. files skipped for not
    decoding; the run's summary records it under ``data``, its counts added over the
    data-parallel ranks (``gpuflow.train.data_report``).
    ``loss_units(target)`` counts what ``loss_fn`` averages over in a batch (its target tokens,
    a tensor or int) when that number varies: training then weighs each batch's loss by its
    units over the whole step's on all ranks (``gpuflow.train.units``), so that data-parallel
    ranks train as one process on their union does; evaluation is unchanged.
    """

    name: str
    model: nn.Module
    train_dataset: Dataset
    val_dataset: Dataset | None = None
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = cross_entropy
    metrics: Mapping[str, MetricFn] = field(default_factory=lambda: {"accuracy": accuracy})
    collate_fn: Callable[[list[Any]], Batch] | None = None
    example_batch: Batch | None = None
    tokens_per_sample: int | None = None
    repeated_blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None
    tensor_parallel_plan: Mapping[str, Any] | None = None
    export_hf: Callable[[nn.Module, Path], None] | None = None
    serving: ServingSpec | None = None
    augment: Callable[[Any, np.random.Generator], Any] | None = None
    default_epochs: float | None = None
    default_ema_decay: float | None = None
    max_sequence_length: int | None = None
    batch_sampler: Callable[[int, int, int], BatchPlan] | None = None
    padding: Callable[[Any], tuple[Any, int]] | None = None
    data_report: Callable[[], Mapping[str, Any]] | None = None
    loss_units: Callable[[torch.Tensor], torch.Tensor | int] | None = None

    def blocks(self) -> list[nn.Module]:
        """The modules that repeat in the model, e.g. transformer layers: ``repeated_blocks``,
        else an ``nn.ModuleList`` attribute ``blocks``, else a Hugging Face model's layers
        (the classes its ``_no_split_modules`` names, held in a ``ModuleList``)."""
        if self.repeated_blocks is not None:
            return list(self.repeated_blocks(self.model))
        found = getattr(self.model, "blocks", None)
        if isinstance(found, nn.ModuleList):
            return list(found)
        return hf.layers(self.model) if hf.is_hf_model(self.model) else []

    def parallel_plan(self, degree: int | None = None) -> Mapping[str, Any] | None:
        """``tensor_parallel_plan``, else a Hugging Face model's own plan, checked for
        ``--tp degree`` when given (a UserError names the layer that plan cannot split)."""
        if self.tensor_parallel_plan is not None or not hf.is_hf_model(self.model):
            return self.tensor_parallel_plan
        return hf.tensor_parallel_plan(self.model, self.blocks(), degree)

    def hf_writer(self) -> Callable[[nn.Module, Path], None]:
        """What writes the trained model in the Hugging Face format: ``export_hf``, or a
        Hugging Face model's own ``save_pretrained``."""
        if self.export_hf is not None:
            return self.export_hf
        if hf.is_hf_model(self.model):
            return hf.save_pretrained
        raise UserError(
            f"Workload {self.name!r} has no Hugging Face form: its model is a "
            f"{type(self.model).__name__}, not a transformers model, and the workload gives no "
            "Workload(export_hf=...) to write one. Export with --format safetensors.")

    def collate(self, samples: list[Any]) -> Batch:
        return (self.collate_fn or default_collate)(samples)

    def get_example_batch(self, size: int = 8) -> Batch:
        """A small real batch, for shape checks and FLOP counting."""
        if self.example_batch is not None:
            return self.example_batch
        if is_stream(self.train_dataset):
            return self.collate(peek(self.train_dataset, size))
        count = min(size, len(self.train_dataset))  # type: ignore[arg-type]
        return self.collate([self.train_dataset[i] for i in range(count)])


BUILTIN_WORKLOADS: dict[str, str] = {
    "asr": "gpuflow.workloads.asr:build",
    "digits": "gpuflow.workloads.digits:build",
    "images": "gpuflow.workloads.images:build",
    "mnist-idx": "gpuflow.workloads.mnist_idx:build",
    "speech": "gpuflow.workloads.speech:build",
    "textlm": "gpuflow.workloads.textlm:build",
}


# Workloads named ``PREFIX:ARGUMENT``: the factory takes the argument first.
PREFIXED_WORKLOADS: dict[str, str] = {"hf": "gpuflow.workloads.hf_dir:build"}


def is_builtin(spec: str) -> bool:
    """Whether ``spec`` names a workload gpuflow ships (``hf:DIR`` included): these take
    ``data="synthetic"``."""
    return spec in BUILTIN_WORKLOADS or spec.partition(":")[0] in PREFIXED_WORKLOADS


def resolve_workload(spec: str, options: Mapping[str, Any] | None = None,
                     serving_state: Mapping[str, Any] | None = None,
                     frozen_precision: str | None = None) -> Workload:
    """Build a workload from a built-in name, ``hf:DIR`` (a Hugging Face model directory)
    or ``pkg.module:factory``. Each of these goes to a factory with a parameter of its name
    (and to no other): ``serving_state``, its codec's state a run saved (a server rebuilds
    from it, not the data); ``frozen_precision``, a LoRA run's precision (its frozen base
    may load straight in the dtype it is held in)."""
    prefix, _, argument = spec.partition(":")
    if prefix in PREFIXED_WORKLOADS:
        options = {"directory": argument, **dict(options or {})}
        spec = PREFIXED_WORKLOADS[prefix]
    target = BUILTIN_WORKLOADS.get(spec, spec)
    if ":" not in target:
        known = ", ".join(sorted(BUILTIN_WORKLOADS))
        raise UserError(
            f"Unknown workload {spec!r}. Use a built-in one ({known}) or "
            "`pkg.module:factory`, where factory() returns a gpuflow.Workload."
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"Cannot import module {module_name!r} for workload {spec!r}: {exc}. "
            "Check the module path and that its package is importable (installed, or on "
            "PYTHONPATH from the directory you run in)."
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(
            f"Module {module_name!r} has no callable {attr!r}; the part after ':' must name "
            "a function that returns a gpuflow.Workload."
        )
    options = dict(options or {})
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        unsupported = [name for name in options
                       if not accepts_any and name not in signature.parameters]
        if unsupported:
            flags = ", ".join("--" + name.replace("_", "-") for name in unsupported)
            raise UserError(
                f"Workload {spec!r} does not take {flags}: its factory {target!r} has no "
                f"parameter{'s' if len(unsupported) > 1 else ''} "
                f"{', '.join(unsupported)}. Drop the flag, or add the parameter to the factory."
            )
        offered = {"serving_state": serving_state, "frozen_precision": frozen_precision}
        options.update({name: value for name, value in offered.items()
                        if value is not None and name in signature.parameters})
    workload = factory(**options)
    if not isinstance(workload, Workload):
        raise UserError(
            f"Workload factory {target!r} returned {type(workload).__name__}, not a "
            "gpuflow.Workload. Return Workload(name=..., model=..., train_dataset=...)."
        )
    check_workload(workload)
    return workload


def check_workload(workload: Workload) -> None:
    """Fail early, with the cause, on the mistakes a plug-in most often makes."""
    if not isinstance(workload.model, nn.Module):
        raise UserError(
            f"Workload {workload.name!r}: model is a {type(workload.model).__name__}, "
            "not a torch.nn.Module."
        )
    for label, dataset in (("train", workload.train_dataset), ("val", workload.val_dataset)):
        if dataset is None:
            continue
        if is_stream(dataset):
            _check_stream(workload, label, dataset)
            continue
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise UserError(
                f"Workload {workload.name!r}: the {label} dataset must be a map-style "
                "dataset (with __len__ and __getitem__) or a torch.utils.data.IterableDataset."
            )
        if len(dataset) == 0:
            raise UserError(f"Workload {workload.name!r}: the {label} dataset is empty.")
        sample = dataset[0]
        if not isinstance(sample, tuple | list) or len(sample) != 2:
            raise UserError(
                f"Workload {workload.name!r}: the {label} dataset must yield (inputs, target) "
                f"pairs; item 0 is a {type(sample).__name__}"
                + (f" of length {len(sample)}" if isinstance(sample, tuple | list) else "")
                + "."
            )


def _check_stream(workload: Workload, label: str, dataset: Any) -> None:
    """A stream's first samples must collate into an ``(inputs, target)`` batch (its
    samples themselves may be anything the workload's ``collate_fn`` turns into one)."""
    samples = peek(dataset, 2) if not is_sized(dataset) or len(dataset) else []
    if not samples:
        raise UserError(f"Workload {workload.name!r}: the {label} stream yields no samples.")
    batch = workload.collate(samples)
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise UserError(
            f"Workload {workload.name!r}: the {label} stream's samples must collate into an "
            f"(inputs, target) batch; its collate_fn gave a {type(batch).__name__}. Yield "
            "(inputs, target) pairs, or give the Workload a collate_fn that builds them."
        )


def serving_state(workload: Workload) -> dict[str, Any]:
    """What the workload's codec needs from training, JSON-able, to save with the run."""
    if workload.serving is not None:
        return {"spec": dict(workload.serving.state)}
    inputs, _ = workload.get_example_batch()
    try:
        schema = InputSchema.of(inputs, workload.model)
    except TypeError:
        return {}  # not servable by TensorCodec; make_codec says why when asked
    schema = sequence_schema(schema, workload.model, workload.max_sequence_length)
    return {"inputs": schema.to_json()}


def make_codec(workload: Workload, state: Mapping[str, Any] | None = None) -> Codec:
    """The workload's codec (``gpuflow.serving``), from the state saved at training (or, for
    a run saved before gpuflow saved it, from the rebuilt workload)."""
    state = serving_state(workload) if state is None else state
    if workload.serving is not None:
        return workload.serving.codec(workload.model, state.get("spec", workload.serving.state))
    if "inputs" not in state:
        inputs, _ = workload.get_example_batch()
        raise UserError(f"Workload {workload.name!r} cannot be served: its inputs are a "
                        f"{type(inputs).__name__} with parts that are not tensors; declare "
                        "Workload(serving=ServingSpec(...)) with a codec that decodes them.")
    schema = InputSchema.from_json(state["inputs"])
    return TensorCodec(schema, mask_keywords(schema, workload.model))
