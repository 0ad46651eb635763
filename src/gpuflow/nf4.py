"""A QLoRA run's frozen base held as NF4 (``--quantize-base nf4``): torchao's ``NF4Tensor``,
the weight type torchtune's QLoRA holds its base in.

Each linear weight becomes 4-bit NormalFloat codes in blocks of 64 weights, each block's
scale quantized again to 8 bits (QLoRA's double quantization): ~4.13 bits a weight where
torchtune's blocks of 256 scales fit, a little more in a small layer (the scales' blocks
shrink to what its size divides into, and to an eighth of its blocks at most, so that
FSDP2 can shard them). ``F.linear`` on an ``NF4Tensor`` is torchao's
``linear_nf4``: the weight is dequantized to its original dtype for that one layer, in the
forward and again in the backward, and never held whole. torchao is imported only here,
when a run asks for NF4 (``gpuflow.lazy_torchao``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from gpuflow.errors import UserError

NF4 = "nf4"
BLOCK = 64  # weights a 4-bit code block's scale covers (QLoRA, torchtune)
SCALER_BLOCK = 256  # block scales one 8-bit scale block covers, where the layer divides
# The blocks of scales come in a multiple of this where a layer's blocks allow, so that FSDP2
# splits them (as it splits the codes) evenly over 2, 4 or 8 ranks.
SHARDS = 8


def quantize(layers: Iterable[tuple[str, nn.Linear]]) -> None:
    """Replace each named layer's weight by its NF4 codes, frozen; the weight keeps its
    dtype as the dtype it dequantizes to."""
    try:
        from torchao.quantization import NF4Tensor
    except ImportError:
        raise UserError("--quantize-base nf4 holds the base in torchao's NF4Tensor, and "
                        "torchao is not installed: pip install 'gpuflow[fp8]' (or torchao)."
                        ) from None
    for name, layer in layers:
        count = layer.weight.numel()
        if count % BLOCK:
            raise UserError(f"--quantize-base nf4: {name}'s weight holds {count:,} values, "
                            f"not a multiple of NF4's block of {BLOCK}; train this model "
                            "without --quantize-base.")
        blocks = count // BLOCK
        scaler = math.gcd(blocks // SHARDS if blocks % SHARDS == 0 else blocks, SCALER_BLOCK)
        codes = NF4Tensor.from_tensor(layer.weight.detach(), BLOCK, scaler)
        layer.weight = nn.Parameter(codes, requires_grad=False)


def is_nf4(weight: torch.Tensor) -> bool:
    """Whether ``weight`` holds NF4 codes (torchao's ``NF4Tensor``), without importing
    torchao where nothing has been quantized."""
    return callable(getattr(weight, "get_original_weight", None))


def check_shards(model: nn.Module, ranks: int) -> None:
    """FSDP2 splits an NF4 weight's rows, and its codes and scales with them (torchao's
    ``split``), into equal parts: refuse a layer whose parts do not divide over ``ranks``."""
    for name, param in model.named_parameters():
        if not is_nf4(param):
            continue
        parts = {"rows": param.shape[0], "blocks of codes": param.n_blocks,
                 "blocks of scales": param.quantization_factor.numel()}
        uneven = [f"{count} {part}" for part, count in parts.items() if count % ranks]
        if uneven:
            raise UserError(f"--quantize-base nf4 with --strategy fsdp: {name} has "
                            f"{', '.join(uneven)}, which FSDP2 cannot split evenly over "
                            f"{ranks} ranks; use a number of ranks that divides them, or "
                            "--strategy single.")


def dequantize(model: nn.Module) -> None:
    """Every NF4 weight of ``model`` back to a plain tensor of its original dtype (the
    weights the run trained against), for a merge or a plain ``state_dict``."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and is_nf4(weight):
            module.weight = nn.Parameter(weight.get_original_weight(), requires_grad=False)
