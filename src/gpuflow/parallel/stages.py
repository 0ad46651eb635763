"""Pipeline stages cut from the model by hand, for models torch.export cannot trace.

A stage is a copy of the whole model in which the repeated blocks of other stages are
replaced by stand-ins, so the model's own forward runs unchanged: the embeddings, masks and
positions before the blocks are computed on every stage from the micro-batch's inputs
(every stage receives them), the stand-in just before this stage's first block hands the
previous stage's activation on in place of its input, and the stand-in just after its last
block stops the forward there and returns that block's output. The last stage runs on to
the model's outputs.

Every stage therefore holds the parameters outside the blocks (embeddings, final norm, the
head); their gradients are summed across the pipeline each step, so the copies stay equal,
as tied weights are kept equal in the traced path.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpuflow.errors import UserError

STAGE_MODEL = "net"  # the model copy's attribute in a stage; its names follow this prefix
_ARG = "_arg"  # positional model inputs travel as keyword arguments _arg0, _arg1, ...


class _StageDone(Exception):
    """Raised by the stand-in after a stage's last block to end the forward there (control
    flow, not an error)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


@dataclass
class _Handoff:
    """The activation received from the previous stage, for the stand-in that passes it on.
    Not a module, so that stand-ins can share it without a cycle of modules."""

    received: torch.Tensor | None = None


@dataclass(frozen=True)
class BlockCall:
    """What a block returns: a tensor (``width`` 0) or a tuple of ``width`` whose first
    element is the hidden state."""

    width: int = 0

    def wrap(self, hidden: torch.Tensor) -> Any:
        return hidden if self.width == 0 else (hidden, *([None] * (self.width - 1)))


class _StandIn(nn.Module):
    """Takes the place of a block held by another stage."""

    def __init__(self, role: str, call: BlockCall, handoff: _Handoff) -> None:
        super().__init__()
        self.role, self.call, self.handoff = role, call, handoff

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else next(iter(kwargs.values()))
        if self.role == "exit":
            raise _StageDone(hidden)
        if self.role == "enter":
            assert self.handoff.received is not None
            hidden = self.handoff.received
        return self.call.wrap(hidden)


def as_keywords(inputs: Any) -> dict[str, Any]:
    """Model inputs as keyword arguments, the form every stage receives them in."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    if isinstance(inputs, tuple | list):
        return {f"{_ARG}{i}": value for i, value in enumerate(inputs)}
    return {f"{_ARG}0": inputs}


def _from_keywords(kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    positional = sorted((k for k in kwargs if k.startswith(_ARG)), key=lambda k: int(k[4:]))
    return (tuple(kwargs[k] for k in positional),
            {k: v for k, v in kwargs.items() if not k.startswith(_ARG)})


@dataclass
class OutputLayout:
    """How the last stage flattens the model's output into tensors for the schedule, and
    how the loss gets it back: a tensor, a tuple, or a mapping (a ``ModelOutput``) whose
    per-sample tensors are kept (a scalar such as a model's own loss is not)."""

    kind: type | None = None
    keys: list[Any] = field(default_factory=list)

    def flatten(self, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            self.kind = torch.Tensor
            return output
        items = (list(output.items()) if isinstance(output, Mapping)
                 else list(enumerate(output)))
        kept = [(key, value) for key, value in items
                if isinstance(value, torch.Tensor) and value.ndim > 0]
        self.kind = type(output)
        self.keys = [key for key, _ in kept]
        return tuple(value for _, value in kept)

    def rebuild(self, flat: Any) -> Any:
        if self.kind is None or self.kind is torch.Tensor:
            return flat
        values = tuple(flat) if isinstance(flat, tuple | list) else (flat,)
        if not issubclass(self.kind, Mapping):
            return values  # a tuple's per-sample tensors
        return self.kind(**dict(zip(self.keys, values, strict=True)))


class ManualStage(nn.Module):
    """One stage: the model with other stages' blocks stood in for."""

    def __init__(self, model: nn.Module, owned: list[str], first: bool,
                 handoff: _Handoff) -> None:
        super().__init__()
        setattr(self, STAGE_MODEL, model)
        self.owned, self.first = owned, first
        self._handoff, self.layout = handoff, OutputLayout()

    def owned_blocks(self) -> list[nn.Module]:
        model = getattr(self, STAGE_MODEL)
        return [model.get_submodule(name) for name in self.owned]

    def forward(self, *received: torch.Tensor, **inputs: Any) -> Any:
        args, kwargs = _from_keywords(inputs)
        self._handoff.received = None if self.first else received[0]
        try:
            output = getattr(self, STAGE_MODEL)(*args, **kwargs)
        except _StageDone as done:
            return done.hidden
        finally:
            self._handoff.received = None
        return self.layout.flatten(output)


def _block_calls(model: nn.Module, blocks: Sequence[nn.Module],
                 example: dict[str, Any]) -> list[BlockCall]:
    """Run the model once on the example to learn what each block takes and returns."""
    calls: list[BlockCall | None] = [None] * len(blocks)
    problems: list[str] = []

    def recorder(index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            hidden = args[0] if args else next(iter(kwargs.values()), None)
            out = output[0] if isinstance(output, tuple) and output else output
            if not (isinstance(hidden, torch.Tensor) and isinstance(out, torch.Tensor)
                    and hidden.shape == out.shape):
                problems.append(type(module).__name__)
            calls[index] = BlockCall(len(output) if isinstance(output, tuple) else 0)
        return hook

    handles = [block.register_forward_hook(recorder(i), with_kwargs=True)
               for i, block in enumerate(blocks)]
    args, kwargs = _from_keywords(example)
    training = model.training
    model.eval()  # no dropout, no running statistics updated, no random numbers drawn
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    if problems or any(call is None for call in calls):
        raise UserError(
            "Pipeline stages cut at the repeated blocks need each block to take the hidden "
            "state as its first argument and return a tensor of the same shape (or a tuple "
            f"starting with it); {problems[0] if problems else 'a block'} does not, or is not "
            "called by the model's forward. Give Workload(repeated_blocks=...) the layers "
            "that do, or use --strategy fsdp.")
    return [call for call in calls if call is not None]


def stage_bounds(count: int, stages: int) -> list[tuple[int, int]]:
    """Near-equal runs of blocks, [start, end) per stage (the traced path cuts there too)."""
    cuts = [round(i * count / stages) for i in range(stages + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def build_manual_stages(model: nn.Module, block_names: list[str], stages: int,
                        local: list[int], example: dict[str, Any]) -> list[ManualStage]:
    """This rank's stages (indices ``local`` of ``stages``), each a trimmed model copy."""
    blocks = [model.get_submodule(name) for name in block_names]
    calls = _block_calls(model, blocks, example)
    bounds = stage_bounds(len(blocks), stages)
    built = []
    for index in local:
        start, end = bounds[index]
        handoff = _Handoff()
        originals: dict[str, nn.Module] = {}
        for position, name in enumerate(block_names):
            if start <= position < end:
                continue
            role = ("enter" if position == start - 1 else "exit" if position == end
                    else "pass")
            originals[name] = blocks[position]
            _replace(model, name, _StandIn(role, calls[position], handoff))
        try:
            trimmed = copy.deepcopy(model)
        finally:
            for name, block in originals.items():
                _replace(model, name, block)
        for module in trimmed.modules():
            if isinstance(module, _StandIn):  # the copy's stand-ins share this stage's box
                module.handoff = handoff
        built.append(ManualStage(trimmed, block_names[start:end], first=index == 0,
                                 handoff=handoff))
    return built


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def shared_parameter_names(model: nn.Module, block_names: list[str]) -> list[str]:
    """Parameters outside the blocks, which every manual stage holds."""
    inside = tuple(name + "." for name in block_names)
    return [name for name, _ in model.named_parameters() if not name.startswith(inside)]
