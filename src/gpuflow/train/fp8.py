"""fp8 training through torchao's float8: which layers convert, and what the run needs.

``--precision fp8`` swaps the eligible ``nn.Linear`` layers for torchao's ``Float8Linear``,
whose matmuls cast their operands to float8 with dynamic scales (per tensor, or per row with
``--fp8-recipe rowwise``); everything else computes under bf16 autocast. Layers stay in bf16
when fp8 cannot run them (a dimension not divisible by 16, what ``torch._scaled_mm`` needs)
or would not speed them up (torchao's measured size thresholds for each recipe, from H100
runs; or, with ``--fp8-min-features N``, a dimension under N), and so do the layers outside
the workload's repeated blocks (embeddings, heads), as torchtitan leaves its output layer.
MFU stays measured against the dense bf16 peak: fp8 is a way of reaching it faster, not a
bigger denominator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpuflow.config_fields import Fp8Recipe
from gpuflow.errors import UserError

# float8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards.
MIN_CAPABILITY = (8, 9)
FP8_ALIGNMENT = 16
INSTALL_HINT = "pip install 'gpuflow[fp8]' (torchao)"


@dataclass(frozen=True)
class Fp8Conversion:
    """What the conversion did, for the banner and the run's summary."""

    recipe: str
    min_features: int | None  # None: torchao's size thresholds for the recipe
    converted: int
    too_small: int
    not_divisible: int
    outside_blocks: int
    fsdp_float8_all_gather: bool
    emulated: bool

    @property
    def linear_layers(self) -> int:
        return self.converted + self.too_small + self.not_divisible + self.outside_blocks

    def describe(self) -> str:
        small = ("too small to gain" if self.min_features is None
                 else f"with a dimension under {self.min_features}")
        kept = [f"{count} {why}" for count, why in (
            (self.too_small, small),
            (self.not_divisible, f"with a dimension not divisible by {FP8_ALIGNMENT}"),
            (self.outside_blocks, "outside the repeated blocks")) if count]
        gather = ", fp8 all-gather under FSDP" if self.fsdp_float8_all_gather else ""
        return (f"fp8 {self.recipe} in {self.converted} of {self.linear_layers} linear layers"
                + (f" (bf16: {', '.join(kept)})" if kept else "") + gather
                + (", emulated" if self.emulated else ""))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_device(device: torch.device) -> None:
    """fp8 matmuls need float8 tensor cores: refuse anywhere else, saying what would run."""
    if device.type != "cuda":
        raise UserError(
            f"--precision fp8 needs an NVIDIA GPU with float8 tensor cores (H100, H200, L40S, "
            f"RTX 4090 or newer); this run is on {device.type}. Use --precision bf16 here.")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise UserError(
            f"--precision fp8 needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"or newer for float8 matmuls; {name} has {capability[0]}.{capability[1]}. "
            "Use --precision bf16.")
    _torchao()


def _torchao() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError:
        raise UserError(f"--precision fp8 trains through torchao: {INSTALL_HINT}.") from None
    return float8


def linear_config(recipe: Fp8Recipe, *, emulate: bool = False,
                  fsdp_all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``; FSDP2 all-gathers weights already cast
    to float8 where torchao offers it (the tensorwise recipe), halving the gather's bytes."""
    float8 = _torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather
                               and recipe == "tensorwise")


def _why_kept(module: nn.Linear, gains: Callable[[nn.Module, str], bool]) -> str | None:
    """None when ``module`` should compute in fp8, else the summary field naming why not."""
    out_features, in_features = module.weight.shape
    if in_features % FP8_ALIGNMENT or out_features % FP8_ALIGNMENT:
        return "not_divisible"
    if not gains(module, ""):
        return "too_small"
    return None


def size_filter(recipe: Fp8Recipe, min_features: int | None
                ) -> Callable[[nn.Module, str], bool]:
    """Whether a linear layer is large enough to gain from fp8: torchao's thresholds for
    ``recipe`` (measured on H100s), or both dimensions at least ``min_features``."""
    if min_features is None:
        return _torchao()._auto_filter_for_recipe(recipe, [])
    return lambda module, fqn: min(module.weight.shape) >= min_features


def convert(model: nn.Module, blocks: Sequence[nn.Module], recipe: Fp8Recipe, *,
            emulate: bool = False, fsdp_all_gather: bool = False,
            min_features: int | None = None) -> Fp8Conversion:
    """Swap ``model``'s eligible linear layers for ``Float8Linear`` in place.

    ``blocks`` are the workload's repeated blocks (all of the model when it has none);
    ``emulate`` runs the float8 matmuls in fp32 on any device (tests); ``min_features``
    (--fp8-min-features) replaces torchao's size thresholds, 0 converting every layer whose
    dimensions fp8 can run.
    """
    float8 = _torchao()
    inside = {id(module) for block in blocks for module in block.modules()} if blocks else None
    gains = size_filter(recipe, min_features)
    counts = {"converted": 0, "too_small": 0, "not_divisible": 0, "outside_blocks": 0}

    def eligible(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        why = "outside_blocks" if inside is not None and id(module) not in inside else \
            _why_kept(module, gains)
        counts[why or "converted"] += 1
        return why is None

    config = linear_config(recipe, emulate=emulate, fsdp_all_gather=fsdp_all_gather)
    float8.convert_to_float8_training(model, module_filter_fn=eligible, config=config)
    conversion = Fp8Conversion(recipe=recipe, min_features=min_features, **counts,
                               fsdp_float8_all_gather=config.enable_fsdp_float8_all_gather,
                               emulated=emulate)
    if not conversion.converted:
        lower = "" if min_features is None else ", or a lower --fp8-min-features"
        raise UserError(f"--precision fp8: none of the model's {conversion.linear_layers} "
                        f"linear layers can compute in fp8 ({conversion.describe()}); use "
                        f"--precision bf16{lower}.")
    return conversion


def precompute_scales_after_step(optimizer: torch.optim.Optimizer, model: nn.Module
                                 ) -> Callable[[], None]:
    """Under fp8 all-gather, compute every sharded weight's scale in one fused reduction
    after each optimizer step rather than one per layer in the next forward (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``, as torchtitan does). Returns the remover."""
    precompute = _torchao().precompute_float8_dynamic_scale_for_fsdp
    handle = optimizer.register_step_post_hook(lambda *_: precompute(model))
    return handle.remove
