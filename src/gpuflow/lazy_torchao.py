"""torchao stays unimported until gpuflow asks for it (``--quantize int8``, ``--precision fp8``).

Importing transformers' model classes (``transformers.modeling_utils``) imports its torchao
quantizer, which imports torchao whenever it is installed. torchao's import prints a "Failed
to load" line for each kernel library the installed torch cannot load, and registers enums
with torch's pytree, which warns twice: noise at every start of ``gpuflow serve`` (and of
training a Hugging Face model), for a library only int8 serving and fp8 training use, and
they import it themselves. ``install`` (``import gpuflow`` runs it) hides torchao from that
one module while it loads: its import-time check sees no torchao; then the module gets the
real check back, and the one torchao function it would have imported becomes one that
imports torchao when first called, so a torchao-quantized checkpoint still loads and saves
through transformers.
"""

from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

QUANTIZER = "transformers.quantizers.quantizer_torchao"
CHECK = "is_torchao_available"


def _absent(*args: Any, **kwargs: Any) -> bool:
    return False


def _flatten_tensor_state_dict(*args: Any, **kwargs: Any) -> Any:
    """torchao's, imported when transformers first saves a torchao-quantized model."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    return flatten_tensor_state_dict(*args, **kwargs)


class _QuietLoader:
    """The quantizer module's own loader, run while transformers says torchao is absent."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        utils = sys.modules.get("transformers.utils")
        real = getattr(utils, CHECK, None)
        if real is None:  # a transformers that checks otherwise: load it as it is
            self.loader.exec_module(module)
            return
        before = set(sys.modules)
        setattr(utils, CHECK, _absent)
        try:
            self.loader.exec_module(module)
        finally:
            setattr(utils, CHECK, real)
            # Every module that imported the check meanwhile keeps the real one.
            for name in {*sys.modules.keys() - before, module.__name__}:
                if getattr(sys.modules.get(name), CHECK, None) is _absent:
                    setattr(sys.modules[name], CHECK, real)
        if real() and not hasattr(module, "flatten_tensor_state_dict"):
            module.flatten_tensor_state_dict = _flatten_tensor_state_dict


class _Finder:
    """Hands transformers' torchao quantizer to ``_QuietLoader`` while torchao is not
    imported; finds nothing else."""

    @staticmethod
    def find_spec(name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != QUANTIZER or "torchao" in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec


def install() -> None:
    """Hide torchao from transformers' model classes until gpuflow imports it; idempotent."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
