"""A run's weights and optimizer state in and out of checkpoints, whatever the strategy.

One process saves the full state. Distributed runs save each rank's local view (DTensor
shards, pipeline stages) with torch.distributed.checkpoint and load by asking for their own
local view, which torch.distributed.checkpoint fills from whatever layout wrote it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from gpuflow.parallel.pipeline import Pipeline

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)

State = tuple[dict[str, torch.Tensor], dict[str, Any]]


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> State:
    """Unsharded weights and optimizer state keyed by parameter name."""
    return (get_model_state_dict(model, options=FULL_STATE),
            get_optimizer_state_dict(model, optimizer, options=FULL_STATE))


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                pipeline: Pipeline | None) -> State:
    """This rank's share of the weights and optimizer state, keyed by parameter name."""
    if pipeline is not None:
        return pipeline.state_to_save(optimizer)
    return get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)


def load_full(model: nn.Module, optimizer: torch.optim.Optimizer, pipeline: Pipeline | None,
              model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> None:
    """Load a complete state, as one process saves it, into any strategy."""
    if pipeline is not None:
        pipeline.load(model_state, optimizer, optimizer_state, full=True)
        return
    set_model_state_dict(model, model_state, options=FULL_STATE)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=FULL_STATE)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer,
                 pipeline: Pipeline | None, path: Path,
                 param_groups: list[dict[str, Any]]) -> None:
    """Read this rank's share of a torch.distributed.checkpoint folder written by any
    world size or strategy (a collective when distributed).

    ``param_groups`` carries the optimizer hyperparameters (learning rate and the like),
    which live in the trainer state rather than among the shards.
    """
    if pipeline is not None:
        metadata = dcp.FileSystemReader(path).read_metadata()
        saved = {key.removeprefix("model.") for key in metadata.state_dict_metadata
                 if key.startswith("model.")}
        model_request, optimizer_request = pipeline.state_to_load(optimizer, saved)
    else:
        model_request = get_model_state_dict(model)
        optimizer_request = get_optimizer_state_dict(model, optimizer)
    state = {"model": model_request, "optimizer": optimizer_request["state"]}
    dcp.load(state, checkpoint_id=path)
    groups = with_saved_settings(param_groups, optimizer_request["param_groups"])
    optimizer_state = {"state": state["optimizer"], "param_groups": groups}
    if pipeline is not None:
        pipeline.load(state["model"], optimizer, optimizer_state, full=False)
        return
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, optimizer_state)
