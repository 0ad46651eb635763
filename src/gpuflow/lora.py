"""LoRA adapters through PEFT: the base frozen, low-rank adapters trained beside it.

Training wraps the workload's model here (``--lora-rank``); the export reads the same
wrapping back to write PEFT's own files (``adapter_config.json`` and
``adapter_model.safetensors``) or to merge the adapters into the base. With ``--quantize-base
nf4`` (QLoRA) the frozen linear layers are held as NF4 (``gpuflow.nf4``). PEFT is imported
only when a run asks for adapters (``gpuflow[hf]``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpuflow import hf, model_dir, nf4
from gpuflow.errors import UserError

ALL_LINEAR = "all-linear"
HALF_DTYPES = (torch.bfloat16, torch.float16)
ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)
TORCHAO_CHECK = "is_torchao_available"


@dataclass(frozen=True)
class LoraSpec:
    """What ``--lora-rank``, ``--lora-alpha``, ``--lora-dropout`` and ``--lora-targets``
    ask for, with ``--quantize-base``; ``alpha`` None means twice the rank (a scale of 2,
    whatever the rank)."""

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: str = ALL_LINEAR
    quantize: str | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> LoraSpec | None:
        """The spec in a run's options (a ``TrainConfig``'s fields, or its saved
        ``config.json``); None when the run trains every weight."""
        if options.get("lora_rank") is None:
            return None
        return cls(int(options["lora_rank"]), options.get("lora_alpha"),
                   float(options.get("lora_dropout") or 0.0),
                   options.get("lora_targets") or ALL_LINEAR, options.get("quantize_base"))

    @property
    def scale_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank


def _output_layer(model: nn.Module) -> nn.Module | None:
    """The layer that maps hidden states to the vocabulary: adapters leave it alone, as
    PEFT's ``all-linear`` does (it is often tied to the input embedding)."""
    getter = getattr(model, "get_output_embeddings", None)
    found = getter() if callable(getter) else None
    return found if isinstance(found, nn.Module) else getattr(model, "lm_head", None)


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The model's linear layers by name, the output layer left out: what ``all-linear``
    targets and what ``--quantize-base`` holds in NF4."""
    output = _output_layer(model)
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not output]


def _linear_names(model: nn.Module) -> list[str]:
    """The last name components of :func:`_linear_layers`, in the order the model holds
    them."""
    return list(dict.fromkeys(name.rpartition(".")[2] for name, _ in _linear_layers(model)))


def _targets(model: nn.Module, spec: LoraSpec) -> list[str]:
    """The module names the adapters attach to, each checked to match only layers PEFT
    attaches adapters to."""
    present = _linear_names(model)
    if spec.targets == ALL_LINEAR:
        if not present:
            raise UserError(f"--lora-targets all-linear: {type(model).__name__} has no linear "
                            "layer besides its output layer to attach adapters to.")
        return present
    wanted = [name.strip() for name in spec.targets.split(",") if name.strip()]
    matched = {target: [module for name, module in model.named_modules()
                        if name == target or name.endswith(f".{target}")] for target in wanted}
    unmatched = [target for target, modules in matched.items() if not modules]
    other = {target: type(next(m for m in modules if not _adaptable(m))).__name__
             for target, modules in matched.items() if not all(map(_adaptable, modules))}
    if unmatched or other or not wanted:
        why = ("no name given for any module" if not wanted else
               f"{', '.join(unmatched)} names no module" if unmatched else
               "; ".join(f"{target} names a {kind}" for target, kind in other.items()))
        raise UserError(f"--lora-targets {spec.targets}: {why} of "
                        f"{type(model).__name__}, where adapters attach to linear, embedding "
                        f"and convolution layers. Its linear layers are "
                        f"{', '.join(present) or 'none'}; or give all-linear.")
    return wanted


def _adaptable(module: nn.Module) -> bool:
    """A layer PEFT's LoRA attaches to (``transformers``' ``Conv1D`` is GPT-2's linear)."""
    return isinstance(module, ADAPTABLE) or type(module).__name__ == "Conv1D"


def held_dtype(saved: torch.dtype | None, autocast: torch.dtype | None) -> torch.dtype:
    """The dtype a frozen base is held in: the one its checkpoint was saved in when the run
    autocasts to that dtype, fp32 otherwise (a bf16 weight cannot meet an fp32 activation
    outside autocast). A model directory's workload loads its base in this dtype directly."""
    return saved if saved in HALF_DTYPES and saved == autocast else torch.float32


def frozen_dtype(model: nn.Module, autocast: torch.dtype | None) -> torch.dtype:
    """:func:`held_dtype` for a loaded model, whatever dtype its workload loaded it in."""
    return held_dtype(_saved_dtype(model), autocast)


def _saved_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype in the ``config.json`` of the directory a Hugging Face model was read from
    (the loaded model's own config says the dtype it was loaded in)."""
    path = Path(getattr(model, "name_or_path", "") or "") / "config.json"
    if not hf.is_hf_model(model) or not path.is_file():
        return None
    return model_dir.saved_dtype(json.loads(path.read_text()))


def wrap(model: nn.Module, spec: LoraSpec | None, autocast: torch.dtype | None = None
         ) -> nn.Module:
    """``model`` with adapters (a ``peft.PeftModel``), or as it is when ``spec`` is None.
    The base is frozen and held in :func:`frozen_dtype`, its linear layers as NF4 codes of
    that dtype when ``spec.quantize`` says so; the adapters train in fp32."""
    if spec is None:
        return model
    try:
        import peft
    except ImportError:
        raise UserError("--lora-rank trains adapters through PEFT, which is not installed: "
                        "pip install 'gpuflow[hf]' (or peft).") from None
    targets = _targets(model, spec)
    frozen = _linear_layers(model) if spec.quantize else []
    if spec.quantize and not frozen:
        raise UserError(f"--quantize-base {spec.quantize}: {type(model).__name__} has no "
                        "linear layer besides its output layer to hold in NF4.")
    dtype = frozen_dtype(model, autocast)
    for param in model.parameters():  # not the buffers: rotary frequencies stay fp32
        param.data = param.data.to(dtype)
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.scale_alpha, task_type=_task(model),
                             lora_dropout=spec.dropout, target_modules=targets)
    with warnings.catch_warnings(), _torchao_unasked():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        # PEFT's default keeps adapters beside a 16-bit base in fp32.
        wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=True)
    if autocast is not None:
        _inputs_left_to_autocast(wrapped, peft.tuners.tuners_utils.BaseTunerLayer)
    if frozen:
        nf4.quantize(frozen)  # PEFT keeps each layer it wraps, as its base_layer
        _copy_unquantized(wrapped)
    return wrapped


def _inputs_left_to_autocast(model: nn.Module, adapted: type[nn.Module]) -> None:
    """PEFT casts each adapted layer's input to its adapters' fp32, and autocast casts it
    back for their matmul: the same values, in a copy that backward keeps per layer. Under
    autocast the input goes to the adapters as it is (``peft.helpers.
    disable_input_dtype_casting``, for good)."""
    for module in model.modules():
        if isinstance(module, adapted):
            module.cast_input_dtype_enabled = False


def _copy_unquantized(model: nn.Module) -> None:
    """The frozen weights left out of NF4, copied: ``transformers`` loads a checkpoint's
    weights as views of its file mapped into memory, whose pages quantizing read in; once
    no weight views the file, the mapping and all those pages go."""
    for param in model.parameters():
        if not param.requires_grad and not nf4.is_nf4(param):
            param.data = param.data.clone()


@contextlib.contextmanager
def _torchao_unasked() -> Iterator[None]:
    """PEFT imports torchao, whenever it is installed, to ask whether a layer is quantized
    by it, and torchao's import is noisy (``gpuflow.lazy_torchao``): until something has
    imported torchao no layer can be, so PEFT is told it is absent meanwhile."""
    if "torchao" in sys.modules:
        yield
        return
    checks = [module for name, module in list(sys.modules.items())
              if name.startswith("peft") and hasattr(module, TORCHAO_CHECK)]
    real = [getattr(module, TORCHAO_CHECK) for module in checks]
    for module in checks:
        setattr(module, TORCHAO_CHECK, lambda: False)
    try:
        yield
    finally:
        for module, check in zip(checks, real, strict=True):
            setattr(module, TORCHAO_CHECK, check)


def _task(model: nn.Module) -> str | None:
    """PEFT's ``CAUSAL_LM`` for a ``transformers`` causal LM: its adapter config then says
    so, as ``AutoPeftModelForCausalLM`` expects; None for any other model."""
    if not hf.is_hf_model(model):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return "CAUSAL_LM" if causal else None


def load_adapters(model: nn.Module, weights: Mapping[str, torch.Tensor], source: Path
                  ) -> None:
    """The adapter weights a checkpoint holds (the trained ones only) into ``model``, a
    :func:`wrap` of the base: every adapter weight must be there, and nothing else."""
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    missing, unexpected = sorted(trained - weights.keys()), sorted(weights.keys() - trained)
    if missing or unexpected:
        wrong = "; ".join(f"{kind}: {', '.join(names[:3])}" for kind, names in
                          (("missing", missing), ("unexpected", unexpected)) if names)
        raise UserError(f"The adapters in {source} do not fit the run's LoRA settings "
                        f"({wrong}).")
    model.load_state_dict(dict(weights), strict=False)


def save_adapters(model: nn.Module, out: Path) -> None:
    """PEFT's files: ``adapter_config.json`` and ``adapter_model.safetensors``, which
    ``peft.PeftModel.from_pretrained(base, out)`` opens."""
    model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]


def merged(model: nn.Module) -> nn.Module:
    """The base with the adapters added into its weights, PEFT's wrapping gone; an NF4 base
    dequantized first, so the merge is in the base's dtype."""
    nf4.dequantize(model)
    return model.merge_and_unload()  # type: ignore[operator]
