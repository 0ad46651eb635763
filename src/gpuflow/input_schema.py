"""The tensors a model takes, as the default codec checks them: each input's name, dtype and
per-sample shape, and for a sequence model which first dimension takes any length up to the
model's context.

The schema is read from the example batch at training time and saved with the run
(``serving.json``), so a server checks requests without the training code. It is apart from
``gpuflow.serving`` (requests and codecs) because it knows only tensors: what the model is
called with, and how rows of different lengths pad into one batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

MASK = "attention_mask"  # the keyword a Hugging Face model (and many others) takes its mask by


class InputError(ValueError):
    """A request whose inputs do not fit the model (HTTP 422)."""


@dataclass(frozen=True)
class InputField:
    """One tensor the model takes: its name, dtype and per-sample shape. A shape whose first
    dimension is ``None`` is a sequence: any length from 1 to ``max_length``."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    max_length: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def is_sequence(self) -> bool:
        return bool(self.shape) and self.shape[0] is None

    @property
    def is_integer(self) -> bool:
        """Token ids, masks and positions: neither floating point nor complex."""
        dtype = self.torch_dtype
        return not (dtype.is_floating_point or dtype.is_complex)

    def describe(self) -> str:
        """What the model takes, as error messages show it, e.g. ``[N, 1..256] int64``."""
        dims = [f"1..{self.max_length}" if size is None else str(size) for size in self.shape]
        return f"[{', '.join(['N', *dims])}] {self.dtype}"

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether one sample of ``shape`` fits, a sequence being of any length in range."""
        if len(shape) != len(self.shape):
            return False
        if self.is_sequence and not 1 <= shape[0] <= (self.max_length or 0):
            return False
        return all(want is None or want == got for want, got in zip(self.shape, shape,
                                                                     strict=True))

    def _numeric(self, values: Any, where: str) -> torch.Tensor:
        """``values`` as a tensor, refused when not numeric or fractional for integer ids."""
        try:
            tensor = torch.tensor(values)
        except (TypeError, ValueError, RuntimeError):
            raise InputError(f"{where} must be a list of equally shaped numeric samples; this "
                             f"model takes {self.describe()}.") from None
        if tensor.is_floating_point() and tensor.numel() and self.is_integer:
            raise InputError(f"{where} holds fractional numbers; this model takes integers: "
                             f"{self.describe()}.")
        return tensor

    def sample(self, values: Any, where: str) -> torch.Tensor:
        """One sample in this field's dtype, or an InputError naming what the model takes;
        a tensor (a packed sample, as in training) is only cast."""
        tensor = values if isinstance(values, torch.Tensor) else self._numeric(values, where)
        if (self.is_sequence and tensor.ndim == len(self.shape)
                and not 1 <= len(tensor) <= (self.max_length or 0)):
            unit = "tokens" if self.is_integer else "positions"
            raise InputError(f"{where} has {len(tensor)} {unit}; this model takes 1 to "
                             f"{self.max_length}: {self.describe()}.")
        if not self.fits(tensor.shape):
            raise InputError(f"{where} has shape {list(tensor.shape)}; this model takes "
                             f"{self.describe()}.")
        return tensor.to(self.torch_dtype)

    def samples(self, values: Any, where: str) -> list[torch.Tensor]:
        """The samples of a request's field: a fixed shape's read as one ``[N, *shape]``
        tensor, a sequence's one by one, since their lengths may differ."""
        if not self.is_sequence:
            tensor = self._numeric(values, where)
            if tensor.ndim == 0 or len(tensor) == 0 or tuple(tensor.shape[1:]) != self.shape:
                raise InputError(f"{where} has shape {list(tensor.shape)}; this model takes "
                                 f"{self.describe()}.")
            return list(tensor.to(self.torch_dtype).unbind(0))
        if not isinstance(values, list) or not values:
            raise InputError(f"{where} must be a list of samples; this model takes "
                             f"{self.describe()}.")
        named = [where] if len(values) == 1 else [f"{where}[{i}]" for i in range(len(values))]
        return [self.sample(value, name) for value, name in zip(values, named, strict=True)]

    def example(self, length: int) -> torch.Tensor:
        """A sample for warm-up: zeros, or for a sequence ``length`` ones (an all-zero
        attention mask would mask every position)."""
        if not self.is_sequence:
            return torch.zeros(self.shape, dtype=self.torch_dtype)  # type: ignore[arg-type]
        return torch.ones((length, *self.shape[1:]), dtype=self.torch_dtype)  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        return data if self.max_length is None else {**data, "max_length": self.max_length}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> InputField:
        """A saved field; one saved before sequences were served has an all-int shape."""
        return cls(data["name"], data["dtype"], tuple(data["shape"]), data.get("max_length"))


@dataclass(frozen=True)
class InputSchema:
    """How the model is called: one tensor, a tuple (positional) or a dict (keywords)."""

    call: str  # "tensor" | "positional" | "keyword"
    fields: tuple[InputField, ...]

    @classmethod
    def of(cls, inputs: Any, model: nn.Module) -> InputSchema:
        """The schema of an example batch's inputs; positional inputs take the names of the
        model's ``forward`` parameters."""
        def field(name: str, tensor: Any) -> InputField:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"input {name!r} is a {type(tensor).__name__}, not a tensor")
            return InputField(name, str(tensor.dtype).removeprefix("torch."),
                              tuple(tensor.shape[1:]))

        if isinstance(inputs, torch.Tensor):
            return cls("tensor", (field("inputs", inputs),))
        if isinstance(inputs, Mapping):
            return cls("keyword", tuple(field(str(k), v) for k, v in inputs.items()))
        names = parameter_names(model, len(inputs))
        return cls("positional", tuple(field(n, v) for n, v in zip(names, inputs, strict=True)))

    def to_json(self) -> dict[str, Any]:
        return {"call": self.call, "fields": [f.to_json() for f in self.fields]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> InputSchema:
        return cls(data["call"], tuple(InputField.from_json(f) for f in data["fields"]))

    @property
    def max_length(self) -> int | None:
        """The longest sequence taken; None when every input has a fixed shape."""
        return next((f.max_length for f in self.fields if f.is_sequence), None)

    def with_sequences(self, max_length: int, integer_only: bool) -> InputSchema:
        """This schema with its sequences taking any length up to ``max_length``: the inputs
        (integer ones only, when ``integer_only``) whose first per-sample dimension is the
        first such input's, the example's sequence length."""
        eligible = [f for f in self.fields if f.shape and (f.is_integer or not integer_only)]
        if not eligible or eligible[0].is_sequence:
            return self
        length = eligible[0].shape[0]
        return replace(self, fields=tuple(
            replace(f, shape=(None, *f.shape[1:]), max_length=max_length)
            if f in eligible and f.shape[0] == length else f for f in self.fields))

    def inputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        """What the model is called with, from one tensor per field."""
        if self.call == "tensor":
            return tensors[0]
        if self.call == "positional":
            return tuple(tensors)
        return {f.name: t for f, t in zip(self.fields, tensors, strict=True)}

    def tensors(self, inputs: Any) -> list[torch.Tensor]:
        """One tensor per field from what the model is called with (a packed sample)."""
        if self.call == "tensor":
            return [torch.as_tensor(inputs)]
        if self.call == "positional":
            return [torch.as_tensor(value) for value in inputs]
        return [torch.as_tensor(inputs[f.name]) for f in self.fields]

    def row(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """One sample's tensors, one per field, refused when its sequences differ in length."""
        lengths = {f.name: len(t) for f, t in zip(self.fields, tensors, strict=True)
                   if f.is_sequence}
        if len(set(lengths.values())) > 1:
            raise InputError("a sample's sequences must be equally long; got "
                             + ", ".join(f"{name} {n}" for name, n in lengths.items()) + ".")
        return tuple(tensors)

    def length(self, row: Sequence[torch.Tensor]) -> int:
        """A row's sequence length (its first sequence input's)."""
        return next(len(t) for f, t in zip(self.fields, row, strict=True) if f.is_sequence)

    def padded(self, rows: Sequence[Sequence[torch.Tensor]], width: int
               ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Rows of sequences right-padded with zeros to ``width`` and stacked, one tensor per
        field, and the attention mask of the batch: 1 for a real position, 0 for padding."""
        lengths = torch.tensor([self.length(row) for row in rows])
        columns = []
        for index, f in enumerate(self.fields):
            if not f.is_sequence:
                columns.append(torch.stack([row[index] for row in rows]))
                continue
            column = torch.zeros((len(rows), width, *f.shape[1:]),  # type: ignore[arg-type]
                                 dtype=f.torch_dtype)
            for i, row in enumerate(rows):
                column[i, : len(row[index])] = row[index]
            columns.append(column)
        return columns, (torch.arange(width) < lengths[:, None]).long()


def parameter_names(model: nn.Module, count: int) -> list[str]:
    """The names of ``model.forward``'s first ``count`` positional parameters, or ``0``,
    ``1``, ... when they cannot be read."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    names = [p.name for p in parameters
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:count]
    return names if len(names) == count else [str(i) for i in range(count)]


def _hf_text_config(model: nn.Module) -> Any | None:
    """A ``transformers`` model's text config (``config.get_text_config()``), None for any
    other model. Read through the config's own API rather than ``gpuflow.hf.is_hf_model``:
    the serving contract sits beside ``gpuflow.hf`` in the import layers, not above it."""
    getter = getattr(getattr(model, "config", None), "get_text_config", None)
    return getter() if callable(getter) else None


def sequence_schema(schema: InputSchema, model: nn.Module,
                    max_sequence_length: int | None) -> InputSchema:
    """``schema`` with its sequences taking any length up to the model's context.

    The context is the workload's ``max_sequence_length``, else a Hugging Face config's
    ``max_position_embeddings`` (GPT-2: ``n_positions``); a model with neither keeps its
    example's shapes. A Hugging Face model's sequences are its integer inputs (token ids,
    masks, positions, labels), never e.g. its pixel values; for any other model the length
    declared applies to every input whose first dimension is the example's sequence.
    """
    config = _hf_text_config(model)
    context = next((value for name in ("max_position_embeddings", "n_positions")
                    if isinstance(value := getattr(config, name, None), int) and value > 0),
                   None)
    limit = max_sequence_length or context
    if limit is None:
        return schema
    return schema.with_sequences(limit, integer_only=config is not None)


def mask_keywords(schema: InputSchema, model: nn.Module) -> tuple[str, ...] | None:
    """The keywords to call ``model`` by, one per field, when the codec builds it an
    attention mask: a sequence model whose ``forward`` takes ``attention_mask`` that its
    inputs do not hold. None when no mask is built (also when a positional input's name in
    ``forward`` is unknown, since the mask can then only go by keyword)."""
    if schema.max_length is None or any(f.name == MASK for f in schema.fields):
        return None
    try:
        takes_mask = MASK in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if not takes_mask:
        return None
    if schema.call == "keyword":
        return tuple(f.name for f in schema.fields)
    names = parameter_names(model, len(schema.fields))
    return None if names[0] == "0" else tuple(names)
