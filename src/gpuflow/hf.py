"""Hugging Face models in the workload contract: their layers, their tensor-parallel plan.

A ``transformers`` model carries what gpuflow otherwise asks a workload for: the classes
of its repeated layers (``_no_split_modules``) and, for many language models, how to split
them for tensor parallelism (``config.base_model_tp_plan``). This module reads both.
``transformers`` is never imported here: a model is a Hugging Face model only if the user's
code already imported it to build one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

from gpuflow.errors import UserError


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel``."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers: instances of the classes ``_no_split_modules`` names
    that sit in an ``nn.ModuleList`` (which leaves out e.g. ViT's one embedding module).
    A layer wrapped for activation checkpointing is returned as its wrapper."""
    wanted = set(getattr(model, "_no_split_modules", None) or ())

    def unwrapped(module: nn.Module) -> nn.Module:
        return getattr(module, "_checkpoint_wrapped_module", module)

    return [child for module in model.modules() if isinstance(module, nn.ModuleList)
            for child in module if type(unwrapped(child)).__name__ in wanted]


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    }


def _model_plan(model: nn.Module) -> dict[str, str]:
    """The model's plan with keys relative to the model itself, ``*`` for a layer index."""
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and getattr(model, prefix, None) is not None:
        base = {f"{prefix}.{key}": style for key, style in base.items()}
    return {**base, **dict(getattr(model, "_tp_plan", None) or {})}


def tensor_parallel_plan(model: nn.Module, blocks: Sequence[nn.Module],
                         degree: int | None) -> dict[str, Any]:
    """The model's own plan as DTensor styles keyed relative to each block.

    Entries outside the blocks (embeddings, the LM head) are left out: gpuflow keeps those
    replicated. A layer whose style has no DTensor counterpart here (packed or expert
    layers, weights that need a gradient all-reduce) is an error that names it.
    """
    kind = type(model).__name__
    plan = _model_plan(model)
    if not plan:
        raise UserError(
            f"{kind} ships no tensor-parallel plan (its config has no base_model_tp_plan): "
            "give the Workload a tensor_parallel_plan (keys relative to each repeated block, "
            "e.g. {'attn.c_attn': ColwiseParallel()}), or use --strategy fsdp.")
    names = {id(module): name for name, module in model.named_modules()}
    block_names = [names[id(block)] for block in blocks if id(block) in names]
    styles = _styles()
    relative: dict[str, Any] = {}
    for key, style in plan.items():
        head, star, local = key.partition("*.")
        if not star or not any(name.startswith(head) and name[len(head):].isdigit()
                               for name in block_names):
            continue
        if style not in styles:
            raise UserError(
                f"{kind}'s tensor-parallel plan splits {key.replace('*', '0')} as {style!r}, "
                f"which gpuflow cannot apply (it applies {', '.join(styles)}): give the "
                "Workload a tensor_parallel_plan, or use --strategy fsdp.")
        relative[local] = styles[style]()
    if not relative:
        raise UserError(f"{kind}'s tensor-parallel plan names none of its repeated layers "
                        f"({', '.join(block_names[:2])}, ...): give the Workload a "
                        "tensor_parallel_plan.")
    if degree is not None:
        _check_heads(model, degree)
    return relative


def _check_heads(model: nn.Module, degree: int) -> None:
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % degree:
            raise UserError(
                f"{type(model).__name__} has {heads} {field.replace('_', ' ')}, which "
                f"--tp {degree} cannot divide: each rank must hold whole heads. Pick a "
                "tensor-parallel degree that divides it.")


def save_pretrained(model: nn.Module, directory: Any) -> None:
    """Write a Hugging Face model in its own format: ``config.json`` and safetensors."""
    model.save_pretrained(directory, safe_serialization=True)  # type: ignore[operator]

