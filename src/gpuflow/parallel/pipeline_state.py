"""A pipeline rank's weights and optimizer state under the original model's parameter names.

A rank's stages live under one root (``StageParts``), so their parameters are named
``parts.<i>.<name in the stage>``; a manual stage wraps the model once more. Checkpoints use
the names the whole model gives its parameters, so a pipelined run saves and loads the same
full state as any other strategy; parameters the tracer copied into several stages (a head
tied to its embedding) are stored once, under the name of the parameter they copy.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from gpuflow.checkpoint import with_saved_settings
from gpuflow.errors import UserError
from gpuflow.parallel.stages import STAGE_MODEL

PART_PREFIX = "parts."


class StageParts(nn.Module):
    """This rank's stage modules under one root, for the optimizer and state dicts."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)


@dataclass(frozen=True)
class StageNames:
    """From a rank's local parameter names to the model's: ``canonical`` maps every name of
    the model to the one ``named_parameters()`` reports for that tensor; ``manual`` says
    whether the stages were cut by hand (and so wrap the model)."""

    canonical: dict[str, str]
    manual: bool

    def original(self, local: str) -> str:
        """'parts.1.blocks.3.mlp.fc.weight' -> 'blocks.3.mlp.fc.weight' (a manual stage's
        'parts.1.net.blocks.3.mlp.fc.weight' likewise)."""
        name = local[len(PART_PREFIX):].split(".", 1)[1]
        return name.removeprefix(STAGE_MODEL + ".") if self.manual else name

    def is_canonical_copy(self, local: str) -> bool:
        name = self.original(local)
        return self.canonical.get(name, name) == name

    def checkpoint_name(self, local: str, available: Collection[str]) -> str:
        """The name a checkpoint stores a local tensor under: its own, or for a tied copy
        that the checkpoint does not hold, the name of the parameter it copies."""
        name = self.original(local)
        return name if name in available else self.canonical.get(name, name)


def state_to_save(parts: StageParts, names: StageNames, optimizer: torch.optim.Optimizer
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's weights and optimizer state under the original parameter names
    (tied copies' optimizer state once, as one process would hold it)."""
    model = {names.original(name): tensor
             for name, tensor in get_model_state_dict(parts).items()}
    state = get_optimizer_state_dict(parts, optimizer)
    keep = {name for name in state["state"] if names.is_canonical_copy(name)}
    optim = {
        "state": {names.original(name): value
                  for name, value in state["state"].items() if name in keep},
        "param_groups": [
            {**group, "params": [names.original(n) for n in group["params"] if n in keep]}
            for group in state["param_groups"]
        ],
    }
    return model, optim


def state_to_load(parts: StageParts, names: StageNames, optimizer: torch.optim.Optimizer,
                  model_keys: Collection[str]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors keyed as a checkpoint names them, for torch.distributed
    .checkpoint to fill in place; hand the result to ``load_state``."""
    model = {names.checkpoint_name(name, model_keys): tensor
             for name, tensor in get_model_state_dict(parts).items()}
    state = get_optimizer_state_dict(parts, optimizer)
    optim: dict[str, Any] = {}
    for name, value in state["state"].items():
        optim.setdefault(names.checkpoint_name(name, ()), value)
    return model, {"state": optim, "param_groups": state["param_groups"]}


def load_state(parts: StageParts, names: StageNames, model_state: dict[str, torch.Tensor],
               optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
               full: bool) -> None:
    """Load a state keyed by original names (a full one from any strategy, or what
    ``state_to_load`` was filled with) into this rank's stages."""
    options = StateDictOptions(full_state_dict=full)
    local_model = {}
    for local in get_model_state_dict(parts, options=options):
        name = names.checkpoint_name(local, model_state)
        if name not in model_state:
            raise UserError(f"The checkpoint has no weights for {name!r}.")
        local_model[local] = model_state[name]
    set_model_state_dict(parts, local_model, options=options)
    current = get_optimizer_state_dict(parts, optimizer, options=options)
    saved = optimizer_state["state"]
    states: dict[str, Any] = {}
    used: set[str] = set()
    for group in current["param_groups"]:
        for local in group["params"]:
            name = names.checkpoint_name(local, ())
            if name in saved:
                # Two tied copies on one rank must not share their state tensors.
                states[local] = _clone(saved[name]) if name in used else saved[name]
                used.add(name)
    groups = with_saved_settings(optimizer_state["param_groups"], current["param_groups"])
    set_optimizer_state_dict(parts, optimizer, {"state": states, "param_groups": groups},
                             options=options)


def _clone(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    return value.clone() if isinstance(value, torch.Tensor) else value
