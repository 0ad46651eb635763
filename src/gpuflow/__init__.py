"""gpuflow: train and serve PyTorch models with the accelerator busy, and show where time goes.

The public names load on first use, so ``import gpuflow`` (or ``gpuflow.errors``) does not
bring in the trainer, ``torch.distributed`` or the serving stack; nor does transformers bring
in torchao until gpuflow asks for it (``gpuflow.lazy_torchao``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from gpuflow import lazy_torchao

if TYPE_CHECKING:
    from gpuflow.config import TrainConfig
    from gpuflow.errors import UserError
    from gpuflow.serve.app import create_app
    from gpuflow.serve.settings import ServeSettings
    from gpuflow.serving import ServingSpec
    from gpuflow.train.trainer import RunResult, Trainer, train
    from gpuflow.workload import Workload, accuracy, cross_entropy, resolve_workload

# Each public name and the module that defines it.
_EXPORTS = {
    "RunResult": "gpuflow.train.trainer",
    "ServeSettings": "gpuflow.serve.settings",
    "ServingSpec": "gpuflow.serving",
    "TrainConfig": "gpuflow.config",
    "Trainer": "gpuflow.train.trainer",
    "UserError": "gpuflow.errors",
    "Workload": "gpuflow.workload",
    "accuracy": "gpuflow.workload",
    "create_app": "gpuflow.serve.app",
    "cross_entropy": "gpuflow.workload",
    "resolve_workload": "gpuflow.workload",
    "train": "gpuflow.train.trainer",
}

__all__ = [
    "RunResult",
    "ServeSettings",
    "ServingSpec",
    "TrainConfig",
    "Trainer",
    "UserError",
    "Workload",
    "accuracy",
    "create_app",
    "cross_entropy",
    "resolve_workload",
    "train",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpuflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """``gpuflow.train`` names the function, as it did when this module imported it eagerly:
    the import system's binding of the ``gpuflow.train`` subpackage here is left out."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
lazy_torchao.install()
