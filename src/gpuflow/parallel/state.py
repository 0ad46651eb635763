"""A model's weights and optimizer state in and out of checkpoints, whatever wraps it.

One process saves the full state. Distributed runs save each rank's local view (DTensor
shards) with torch.distributed.checkpoint and load by asking for their own local view, which
torch.distributed.checkpoint fills from whatever layout wrote it. Pipeline stages name their
parameters differently and translate (``gpuflow.parallel.pipelined``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from gpuflow.checkpoint import with_saved_settings

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)

State = tuple[dict[str, torch.Tensor], dict[str, Any]]


def _options(full: bool, frozen: bool) -> StateDictOptions:
    """``frozen`` False leaves out the weights that do not train (a LoRA run's base, which
    the workload rebuilds): saving skips them, loading expects them absent."""
    return StateDictOptions(full_state_dict=full, cpu_offload=full,
                            ignore_frozen_params=not frozen, strict=frozen)


def _weights(model: nn.Module, full: bool, frozen: bool) -> dict[str, torch.Tensor]:
    weights = get_model_state_dict(model, options=_options(full, frozen))
    if frozen:
        return weights
    # A frozen weight tied to another name (an LM head tied to the embedding) is still
    # listed under that name: only the trained parameters' names are kept.
    trained = _trained_names(model)
    return {name: tensor for name, tensor in weights.items() if name in trained}


def _trained_names(model: nn.Module) -> set[str]:
    return {_plain_name(name) for name, param in model.named_parameters()
            if param.requires_grad}


def _plain_name(name: str) -> str:
    """A parameter's name without the wrappers' parts (DDP, activation checkpointing,
    compile), as state dicts name it."""
    name = name.removeprefix("module.")
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, frozen: bool = True
               ) -> State:
    """Unsharded weights and optimizer state keyed by parameter name."""
    return (_weights(model, True, frozen),
            get_optimizer_state_dict(model, optimizer, options=FULL_STATE))


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer, frozen: bool = True
                ) -> State:
    """This rank's share of the weights and optimizer state, keyed by parameter name."""
    return _weights(model, False, frozen), get_optimizer_state_dict(model, optimizer)


def load(model: nn.Module, weights: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
         optimizer_state: dict[str, Any], full: bool, frozen: bool = True) -> None:
    """Load a complete state (``full``) into any wrapping, or this rank's own share."""
    missing, unexpected = set_model_state_dict(model, weights, options=_options(full, frozen))
    wrong = sorted({*unexpected, *_trained_names(model).intersection(map(_plain_name, missing))})
    if wrong:  # only without strict loading: frozen weights are expected to be absent
        raise RuntimeError(f"weights missing or unexpected: {', '.join(wrong[:3])}")
    set_optimizer_state_dict(model, optimizer, optimizer_state,
                             options=FULL_STATE if full else None)


def read_sharded(request: State, path: Path, param_groups: list[dict[str, Any]]) -> State:
    """Fill ``request`` (a local view's weights and optimizer state) from the
    torch.distributed.checkpoint folder ``path``; a collective when distributed.

    ``param_groups`` carries the optimizer hyperparameters (learning rate and the like),
    which live in the trainer state rather than among the shards.
    """
    model_request, optimizer_request = request
    ask_for_extra_entries(optimizer_request["state"], path)
    state = {"model": model_request, "optimizer": optimizer_request["state"]}
    dcp.load(state, checkpoint_id=path)
    groups = with_saved_settings(param_groups, optimizer_request["param_groups"])
    return state["model"], {"state": state["optimizer"], "param_groups": groups}


def ask_for_extra_entries(optimizer_state: dict[str, dict[str, Any]], path: Path) -> None:
    """Add to a fresh optimizer's request the per-parameter entries the checkpoint holds
    beyond its own (a weight average, ``gpuflow.train.averaging``), shaped like the first
    tensor entry of that parameter (its moment, shaped and sharded like the parameter)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, entries in optimizer_state.items():
        like = next((value for value in entries.values()
                     if isinstance(value, torch.Tensor) and value.dim() > 0), None)
        prefix = f"optimizer.{name}."
        extra = {key.removeprefix(prefix) for key in saved if key.startswith(prefix)}
        for entry in extra - entries.keys():
            if like is not None and "." not in entry:
                entries[entry] = torch.empty_like(like)


def saved_model_keys(path: Path) -> set[str]:
    """The parameter names a sharded checkpoint holds."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {key.removeprefix("model.") for key in metadata.state_dict_metadata
            if key.startswith("model.")}
