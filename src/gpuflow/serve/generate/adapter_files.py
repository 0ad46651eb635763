"""LoRA adapters as PEFT writes them (``adapter_config.json`` and
``adapter_model.safetensors``), checked against the served base and read for the engine.

The engine adds an adapter to the projections of the base's decoder layers (queries, keys,
values, output; gate, up, down), the modules PEFT's ``all-linear`` and the usual target
lists name. An adapter is checked when it is registered (``--lora``, ``POST
/v1/load_lora_adapter``) from its config and its file's header alone: LoRA (not DoRA),
no bias or saved modules, each weight's layer and shape those of the base, its rank within
``--max-lora-rank``, trained on a base of this name. Its weights are read only when a
request first needs it (``read_weights``), in the process that steps.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from gpuflow.errors import UserError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# The projections the engine adapts, by where they sit in a decoder layer.
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class BaseLayout:
    """What an adapter must fit: the base's decoder layers, each adapted projection's
    ``(in_features, out_features)``, and the names the base goes by (its directory's and
    its config's), which an adapter's ``base_model_name_or_path`` must be one of."""

    layers: int
    shapes: dict[str, tuple[int, int]]
    names: frozenset[str]

    @classmethod
    def of(cls, model: nn.Module, directory: str | None = None) -> BaseLayout:
        """The layout of a Llama-family model (``model.model.layers``)."""
        layers: Any = model.model.layers  # type: ignore[union-attr]
        first = layers[0]
        shapes = {name: (module.in_features, module.out_features)
                  for name, part in MODULES.items()
                  if isinstance(module := getattr(getattr(first, part), name), nn.Linear)}
        names = {Path(str(p)).name for p in (directory, model.config._name_or_path)  # type: ignore[union-attr]
                 if p}
        return cls(len(layers), shapes, frozenset(names))


@dataclass(frozen=True)
class AdapterRef:
    """An adapter registered with the engine: the id requests name it by (new for every
    registration, so that a name loaded again from other files never meets the old one's
    cached prefixes), its name and its directory."""

    id: int
    name: str
    path: str


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter's weights as the engine adds them: per ``(layer, projection)``, ``A``
    ``[rank, in]`` and ``B`` ``[out, rank]`` with the adapter's scale folded into ``B``."""

    rank: int
    products: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class AdapterRegistry:
    """The adapters a server serves, by the names requests call them (``model``): each
    checked against the base as it is added, given an id never used before."""

    def __init__(self, layout: BaseLayout, max_rank: int, taken: frozenset[str]) -> None:
        self.layout, self.max_rank, self._taken = layout, max_rank, taken
        self._by_name: dict[str, AdapterRef] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[AdapterRef]:
        return iter(list(self._by_name.values()))

    def get(self, name: str) -> AdapterRef | None:
        return self._by_name.get(name)

    def add(self, name: str, path: str) -> AdapterRef:
        """Register ``path`` as ``name``; ``UserError`` for a name in use or an adapter
        that does not fit the base."""
        if not name or name in self._taken or name in self._by_name:
            raise UserError(f"The adapter name {name!r} is "
                            + ("empty" if not name else "taken: names must differ from the "
                               "base model's and each other's") + ".")
        check_adapter(Path(path), self.layout, self.max_rank)
        ref = AdapterRef(next(self._ids), name, str(Path(path).resolve()))
        self._by_name[name] = ref
        return ref

    def remove(self, name: str) -> AdapterRef:
        """Unregister ``name``; ``KeyError`` if no adapter has it."""
        return self._by_name.pop(name)


def check_adapter(path: Path, layout: BaseLayout, max_rank: int) -> int:
    """The adapter's rank, once its directory is checked against the base (see the module
    docstring); ``UserError`` naming what does not fit, and how to fix it."""
    config = _config(path)
    ranks = [shape[0] if kind == "A" else shape[1]
             for (layer, module, kind), shape in _shapes(path, layout).items()]
    rank = max(ranks)
    if rank > max_rank:
        raise UserError(f"The adapter {path} has rank {rank}, past --max-lora-rank "
                        f"{max_rank}: serve with --max-lora-rank {rank} or more.")
    trained_on = config.get("base_model_name_or_path")
    if trained_on and layout.names and Path(str(trained_on)).name not in layout.names:
        raise UserError(f"The adapter {path} was trained on {trained_on!r} "
                        f"(base_model_name_or_path in its {CONFIG}), not on this server's "
                        f"base ({', '.join(sorted(layout.names))}); if it is the same model "
                        f"under another name, set base_model_name_or_path to one of those.")
    return rank


def read_weights(path: Path, layout: BaseLayout, dtype: torch.dtype,
                 device: torch.device) -> AdapterWeights:
    """The adapter's weights on ``device`` in ``dtype``, each ``B`` scaled as PEFT scales it
    (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA; ``alpha_pattern`` per module)."""
    config = _config(path)
    _shapes(path, layout)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path / WEIGHTS), framework="pt") as weights:
        for key in weights.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            match = _KEY.search(key)
            assert match is not None  # _shapes refused any other key
            layer, part, module, kind = match.groups()
            pairs.setdefault((int(layer), module), {})[kind] = weights.get_tensor(key)
    products = {}
    for (layer, module), pair in pairs.items():
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        alpha = _alpha(config, f"model.layers.{layer}.{MODULES[module]}.{module}")
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        products[(layer, module)] = (a.to(device, dtype), (b.float() * scale).to(device, dtype))
    return AdapterWeights(max(a.shape[0] for a, _ in products.values()), products)


def _config(path: Path) -> dict[str, Any]:
    """The adapter's config, refused unless it is a LoRA the engine can add as it is."""
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise UserError(f"{path} is not a LoRA adapter directory: it needs {CONFIG} and "
                        f"{WEIGHTS} (as `gpuflow export` of a --lora-rank run and PEFT's "
                        "save_pretrained write them).")
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path / CONFIG} cannot be read ({exc}).") from None
    kind = config.get("peft_type")
    unsupported = [why for why, present in (
        (f"it is a {kind} adapter, not LORA", kind != "LORA"),
        ("it uses DoRA (use_dora)", config.get("use_dora")),
        (f"it trains biases (bias={config.get('bias')!r})", config.get("bias", "none") != "none"),
        ("it saves whole modules (modules_to_save)", config.get("modules_to_save")),
        ("its weights are stored transposed (fan_in_fan_out)", config.get("fan_in_fan_out")),
    ) if present]
    if unsupported:
        raise UserError(f"The adapter {path} cannot be served: {'; '.join(unsupported)}. The "
                        "engine serves plain LoRA adapters on the decoder layers' projections; "
                        "merge this one into the base (`gpuflow export --merge`) instead.")
    return config


def _shapes(path: Path, layout: BaseLayout) -> dict[tuple[int, str, str], tuple[int, ...]]:
    """Every weight's shape from the file's header, each checked against the base."""
    try:
        with safe_open(str(path / WEIGHTS), framework="pt") as weights:
            shapes = {key: tuple(weights.get_slice(key).get_shape())
                      for key in weights.keys()}  # noqa: SIM118
    except Exception as exc:  # a file that is not safetensors
        raise UserError(f"{path / WEIGHTS} cannot be read ({exc}).") from None
    found: dict[tuple[int, str, str], tuple[int, ...]] = {}
    for key, shape in shapes.items():
        match = _KEY.search(key)
        if match is None or match.group(3) not in layout.shapes:
            raise UserError(f"The adapter {path} holds {key}, a weight of a module the engine "
                            f"does not adapt (it adds adapters to the decoder layers' "
                            f"{', '.join(layout.shapes)}); merge it into the base "
                            "(`gpuflow export --merge`) instead.")
        layer, _, module, kind = match.groups()
        found[(int(layer), module, kind)] = shape
        fan_in, fan_out = layout.shapes[module]
        rank = shape[0] if kind == "A" else shape[-1]
        expected = (rank, fan_in) if kind == "A" else (fan_out, rank)
        if int(layer) >= layout.layers or shape != expected:
            raise UserError(f"The adapter {path} does not fit this base: {key} has shape "
                            f"{list(shape)}, the base's layer {layer} {module} takes "
                            f"{list(expected)} of {layout.layers} layers; it was trained on "
                            "another model.")
    _check_pairs(path, found)
    return found


def _check_pairs(path: Path, found: dict[tuple[int, str, str], tuple[int, ...]]) -> None:
    if not found:
        raise UserError(f"The adapter {path} holds no LoRA weights.")
    for layer, module, kind in found:
        other = "B" if kind == "A" else "A"
        partner = found.get((layer, module, other))
        rank = found[(layer, module, kind)][0 if kind == "A" else 1]
        if partner is None or partner[0 if other == "A" else 1] != rank:
            raise UserError(f"The adapter {path}'s layer {layer} {module} has a lora_{kind} "
                            f"without a lora_{other} of the same rank.")


def _alpha(config: dict[str, Any], module: str) -> float:
    """The module's alpha: ``alpha_pattern``'s first key the module's name ends with, as
    PEFT matches them, else ``lora_alpha``."""
    for key, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(alpha)
    return float(config.get("lora_alpha", config.get("r", 8)))

