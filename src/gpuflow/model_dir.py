"""A Hugging Face causal-LM directory, read as the Hub lays it out and never from the network.

``config.json`` names the architecture; the weights are ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``; the tokenizer, its chat template and
``generation_config.json`` (the end-of-sequence ids and the sampling defaults) sit beside
them. ``check`` reads only JSON, so a command can refuse a directory it cannot use before
it starts a server; ``load_model`` builds the model with ``transformers``, locally, with
safetensors only and without remote code, which gpuflow never runs. Serving reads it
(``gpuflow serve DIR``), and so does fine-tuning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuflow.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is not readable JSON ({exc}).") from None
    if not isinstance(found, dict):
        raise UserError(f"{path} holds a {type(found).__name__}, not a JSON object.")
    return found


def saved_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype a ``config.json`` says its weights were saved in (``dtype``, formerly
    ``torch_dtype``); None where it names none or no torch dtype."""
    import torch

    name = config.get("dtype") or config.get("torch_dtype")
    found = getattr(torch, name, None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) else None


def is_model_directory(path: Path) -> bool:
    """Whether ``path`` holds a Hugging Face model's ``config.json`` (it names a
    ``model_type``; a gpuflow run's ``config.json`` does not)."""
    try:
        return "model_type" in json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False


@dataclass(frozen=True)
class GenerationDefaults:
    """What ``generation_config.json`` says about generating: every id that ends a
    sequence, and the sampling a request gets where it sets none (None: the API's own)."""

    eos_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @classmethod
    def of(cls, generation: dict[str, Any], config: dict[str, Any]) -> GenerationDefaults:
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        greedy = generation.get("do_sample") is False
        return cls(
            eos_ids=tuple(int(token) for token in eos_ids),
            temperature=0.0 if greedy else _number(generation, "temperature"),
            top_p=None if greedy else _number(generation, "top_p"),
            top_k=None if greedy else _integer(generation, "top_k"),
            repetition_penalty=_number(generation, "repetition_penalty"))


def _number(values: dict[str, Any], key: str) -> float | None:
    value = values.get(key)
    return float(value) if isinstance(value, int | float) else None


def _integer(values: dict[str, Any], key: str) -> int | None:
    value = values.get(key)
    return int(value) if isinstance(value, int) else None


@dataclass(frozen=True)
class ModelDirectory:
    """A checked causal-LM directory: its path, ``config.json`` and generation defaults."""

    path: Path
    config: dict[str, Any]
    generation: GenerationDefaults

    @classmethod
    def check(cls, path: Path, weights: bool = True) -> ModelDirectory:
        """The directory, once everything a server needs is there; a UserError says what
        is missing or why it is refused (remote code, weights in pickle files, not a
        causal LM). ``weights=False``: a directory whose weights are not wanted (a model
        trained from random weights of its config)."""
        if not (path / CONFIG_FILE).is_file():
            raise UserError(f"{path} holds no {CONFIG_FILE}: give a Hugging Face model "
                            "directory (config.json, safetensors weights, tokenizer).")
        config = _json(path / CONFIG_FILE)
        _refuse_remote_code(path, config)
        _check_architecture(path, config)
        if weights:
            _check_weights(path)
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise UserError(f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the "
                            "model's tokenizer files into the directory.")
        generation_path = path / GENERATION_FILE
        generation = _json(generation_path) if generation_path.is_file() else {}
        return cls(path, config, GenerationDefaults.of(generation, config))

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    def context_length(self, max_model_len: int | None = None) -> int:
        """The longest sequence served: the config's context, or ``max_model_len`` below
        it (a cache sized for 128k tokens a sequence is rarely wanted)."""
        text = self.config.get("text_config") or self.config
        found = next((text[key] for key in CONTEXT_FIELDS if isinstance(text.get(key), int)),
                     None)
        if found is None:
            if max_model_len is None:
                raise UserError(f"{self.path / CONFIG_FILE} gives no context length "
                                f"({', '.join(CONTEXT_FIELDS)}): pass --max-model-len.")
            return max_model_len
        if max_model_len is not None and max_model_len > found:
            raise UserError(f"--max-model-len {max_model_len} is longer than the context of "
                            f"{found} tokens the model was built for ({self.path / CONFIG_FILE}).")
        return max_model_len or found

    def load_model(self, dtype: torch.dtype | None = None) -> nn.Module:
        """The model in ``dtype`` (default fp32), in eval mode, with SDPA attention (it takes
        the per-row masks the generation engine builds). Every weight must load: none missing
        or misshapen."""
        import torch
        import transformers

        try:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                self.path, local_files_only=True, use_safetensors=True, trust_remote_code=False,
                dtype=dtype or torch.float32, attn_implementation="sdpa",
                output_loading_info=True)
        except Exception as exc:  # OSError, ValueError, safetensors' own errors
            raise UserError(f"The model in {self.path} cannot be loaded "
                            f"({type(exc).__name__}: {exc}).") from None
        wrong = [f"{kind}: {', '.join(sorted(map(str, info[key]))[:3])}"
                 for kind, key in (("missing", "missing_keys"),
                                   ("of another shape", "mismatched_keys"))
                 if info.get(key)]
        if wrong:
            raise UserError(f"The weights in {self.path} do not fit its config.json "
                            f"({'; '.join(wrong)}).")
        return model.eval()


def load_hf_tokenizer(path: Path) -> Any:
    """The ``transformers`` tokenizer saved in directory ``path``, from local files only and
    without running code from the directory (serving wraps it; packing and fine-tuning read
    its vocabulary and special tokens)."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                        "save the model's tokenizer beside its weights.")
    _refuse_remote_code(path, {})
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True,
                                             trust_remote_code=False)
    # A broken or foreign tokenizer fails in many ways; each is the user's to fix.
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError) as error:
        raise UserError(f"cannot load the tokenizer in {path}: {error}") from error


def _refuse_remote_code(path: Path, config: dict[str, Any]) -> None:
    """A directory whose classes live in its own Python files: gpuflow runs no such code."""
    tokenizer_config = path / "tokenizer_config.json"
    tokenizer = _json(tokenizer_config) if tokenizer_config.is_file() else {}
    for where, values in ((path / CONFIG_FILE, config), (tokenizer_config, tokenizer)):
        if values.get("auto_map"):
            raise UserError(f"{path} needs remote code ({where.name} maps classes to Python "
                            f"files in the directory: {values['auto_map']}); gpuflow never "
                            "runs a model's own code. Serve a model transformers "
                            "implements itself.")


def _check_architecture(path: Path, config: dict[str, Any]) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if causal is None:
        raise UserError(f"{path / CONFIG_FILE} names model_type {model_type!r}, which is not a "
                        "causal language model transformers implements "
                        "(AutoModelForCausalLM); gpuflow serves those.")
    saved = config.get("architectures") or [causal]
    if causal not in saved:  # e.g. an encoder saved without its language-model head
        raise UserError(f"{path / CONFIG_FILE} holds a {', '.join(saved)}, not a causal "
                        f"language model ({causal}): its weights have no head to generate "
                        "with.")


def _check_weights(path: Path) -> None:
    """Weights in safetensors, every shard the index names present."""
    index = path / WEIGHTS_INDEX
    if index.is_file():
        shards = sorted(set(_json(index).get("weight_map", {}).values()))
        missing = [name for name in shards if not (path / name).is_file()]
        if not shards or missing:
            raise UserError(f"{index} names shards that are not in the directory: "
                            f"{', '.join(missing[:3]) or 'none listed'}.")
        return
    if (path / WEIGHTS_FILE).is_file():
        return
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise UserError(f"{path} holds its weights as pickle files (.bin/.pt), which gpuflow "
                        "never unpickles; convert them to safetensors "
                        "(model.save_pretrained(DIR, safe_serialization=True)).")
    raise UserError(f"{path} has no weights ({WEIGHTS_FILE} or {WEIGHTS_INDEX}).")
