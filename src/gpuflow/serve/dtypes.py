"""The dtype served weights are held in (``--dtype``) and the KV cache's
(``--kv-cache-dtype``).

``auto`` holds the weights as the checkpoint stores them on an accelerator (its config's
``torch_dtype``), or in the dtype ``--precision`` names when that is bf16 or fp16: autocast
over fp32 weights would cast every weight at every step. On a CPU ``auto`` is fp32, with
``--precision`` an autocast as before (bf16 weights change every op's rounding, autocast
only the matrix products'). The generation engine runs weights held in a reduced dtype
without autocast, its KV cache in the same dtype unless ``--kv-cache-dtype`` says
otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuflow.precision import autocast_dtype

if TYPE_CHECKING:  # the command line reads CHOICES without importing torch
    import torch
    from torch import nn

# The names other servers use, and gpuflow's own precision names, for each torch dtype.
DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32",
          "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}
CHOICES = ("auto", *DTYPES)


def named(name: str) -> torch.dtype:
    """The torch dtype one of ``DTYPES``' names means."""
    import torch

    return getattr(torch, DTYPES[name])


def checkpoint_dtype(model: nn.Module) -> torch.dtype | None:
    """The floating dtype a Hugging Face checkpoint says it was saved in, if it says."""
    config = getattr(model, "config", None)
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    import torch

    if isinstance(saved, str):
        saved = named(saved) if saved in DTYPES else None
    return saved if isinstance(saved, torch.dtype) and saved.is_floating_point else None


def weights_dtype(asked: str, device: torch.device, precision: str,
                  model: nn.Module) -> torch.dtype:
    """The dtype ``--dtype asked`` holds the weights in on ``device`` (see the module)."""
    import torch

    if asked != "auto":
        return named(asked)
    if device.type == "cpu":
        return torch.float32
    return autocast_dtype(precision) or checkpoint_dtype(model) or torch.float32


def kv_cache_dtype(asked: str, weights: torch.dtype, precision: str) -> torch.dtype:
    """The KV cache's dtype: ``asked``, else the weights' when reduced, else what autocast
    computes in (fp32 without one)."""
    import torch

    if asked != "auto":
        return named(asked)
    if weights != torch.float32:
        return weights
    return autocast_dtype(precision) or torch.float32


def short_name(dtype: torch.dtype) -> str:
    """gpuflow's name of a floating dtype: fp32, bf16, fp16."""
    name = str(dtype).removeprefix("torch.")
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)
