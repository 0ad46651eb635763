"""Typed training configuration: defaults, then a TOML file, then explicit CLI flags.

:class:`TrainConfig` is the fields of :class:`gpuflow.config_fields.TrainFields` (each
declares its flag once), checked by :mod:`gpuflow.config_checks`, with the TOML file's
reading and the merge of file and flags.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gpuflow import config_checks
from gpuflow.config_fields import TrainFields, default_strategy
from gpuflow.errors import UserError
from gpuflow.options import check_types


@dataclass
class TrainConfig(TrainFields):
    """Everything a training run needs besides the workload itself: the fields, checked."""

    def validate(self) -> None:
        """Reject values that would fail later with an unhelpful traceback, and options the
        chosen layout cannot use (see :mod:`gpuflow.config_checks`)."""
        config_checks.check_values(self)
        if self.strategy != "auto":
            world = self.nproc * self.nnodes
            config_checks.check_layout(self, self.strategy or default_strategy(world),
                                       chosen=self.strategy is not None)

    def workload_options(self) -> dict[str, Any]:
        """What the workload factory is given: only the options the user actually set."""
        options: dict[str, Any] = {}
        if self.data_dir is not None:
            options["data_dir"] = self.data_dir
        if self.data != "real":
            options["data"] = self.data
        if self.model_size is not None:
            options["model_size"] = self.model_size
        for name in ("tokenizer", "seq_len"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        for flag in ("from_config", "truncate_chats"):
            if getattr(self, flag):
                options[flag] = True
        if self.val_speakers is not None:
            options["val_speakers"] = self.val_speakers
        for name in ("batch_seconds", "max_audio_seconds", "image_size", "decode"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        if self.strict_data:
            options["strict_data"] = True
        return options

    def frozen_precision(self) -> str | None:
        """The precision a LoRA run computes its frozen base under, which the workload may
        load the base in; None when every weight trains (fp32 master weights)."""
        return self.precision if self.lora_rank is not None else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELD_NAMES = frozenset(f.name for f in fields(TrainConfig)) - {"extra"}


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config; keys are the long flag names with '-' or '_'."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"Config file {path} does not exist.") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"Config file {path} is not valid TOML: {exc}.") from None
    values = {key.replace("-", "_"): value for key, value in raw.items()}
    unknown = sorted(set(values) - FIELD_NAMES)
    if unknown:
        raise UserError(
            f"Config file {path} has unknown keys: {', '.join(unknown)}. "
            f"Known keys are the `gpuflow train` flags: {', '.join(sorted(FIELD_NAMES))}."
        )
    return values


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Merge defaults < TOML file < flags and validate the result."""
    merged = {**file_values, **flag_values}
    try:
        config = TrainConfig(**merged)
    except TypeError as exc:
        raise UserError(f"Invalid configuration: {exc}.") from None
    check_types(config)
    config.validate()
    return config

