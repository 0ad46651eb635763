"""Export a run's newest valid checkpoint: one safetensors file for gpuflow's server, or a
Hugging Face model directory for everything that reads that format.

Checkpoints are saved unsharded whatever the strategy, or consolidated from their shards
here, so the export is the same for one process, DDP, FSDP, TP or pipelines.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from gpuflow import checkpoint as ckpt
from gpuflow import lora, storage
from gpuflow.byte_vocab import BYTE_VOCAB_SIZE
from gpuflow.errors import UserError
from gpuflow.precision import autocast_dtype
from gpuflow.serving import RUN_CONFIG_FILE, SERVING_FILE

if TYPE_CHECKING:
    from gpuflow.workload import Workload

EXPORT_FORMAT_VERSION = "1"
ExportFormat = Literal["safetensors", "hf"]
ADVICE = "Free some space or export to another --out on a larger disk."


def _newest(run_dir: Path) -> tuple[ckpt.Checkpoint, dict[str, torch.Tensor], dict[str, Any]]:
    config_path = run_dir / "config.json"
    if not config_path.is_file() or not (run_dir / "checkpoints").is_dir():
        raise UserError(f"{run_dir} is not a gpuflow run dir (no config.json and checkpoints/).")
    found = ckpt.load_latest(run_dir / "checkpoints")
    if found is None:
        raise UserError(f"{run_dir} has no valid checkpoint to export; train it first.")
    checkpoint, model_state, _ = found
    return checkpoint, model_state, json.loads(config_path.read_text())


def export_model(run_dir: Path, out: Path, format: ExportFormat = "safetensors",
                 merge: bool = False) -> tuple[Path, int]:
    """Write the newest verified checkpoint's full weights to ``out``; return (path, step).

    ``safetensors``: one file carrying the run's configuration in its metadata, so a server
    can rebuild the workload's model without the run dir. ``hf``: a directory that
    ``transformers``' ``from_pretrained`` opens, written by the workload
    (``Workload.hf_writer``), with the run's configuration beside it.

    A LoRA run's checkpoint holds only its adapters: ``hf`` writes them in PEFT's format
    (``merge``: the base with the adapters merged, as a whole model directory), and
    ``safetensors`` the merged weights, the only whole model one file can hold.
    """
    checkpoint, model_state, config = _newest(run_dir)
    saved = run_dir / SERVING_FILE
    serving = json.loads(saved.read_text()) if saved.is_file() else None
    spec = lora.LoraSpec.of(config)
    if merge and spec is None:
        raise UserError(f"--merge merges LoRA adapters into their base, and {run_dir} trained "
                        "every weight (no --lora-rank): export it without --merge.")
    if spec is not None:
        workload = _with_adapters(config, spec, model_state, checkpoint, serving)
        if format == "hf" and not merge:
            _write_adapters(workload.model, out)
            return out, checkpoint.step
        workload.model = lora.merged(workload.model)
        model_state = workload.model.state_dict()
        if format == "hf":
            write_hf_export(workload, config, checkpoint.step, out, serving)
            return out, checkpoint.step
    elif format == "hf":
        _export_hf(config, serving, model_state, checkpoint, out)
        return out, checkpoint.step
    metadata = {
        "gpuflow_export_format": EXPORT_FORMAT_VERSION,
        "workload": str(config.get("workload")),
        "step": str(checkpoint.step),
        "config": json.dumps(config),
        **({"serving": json.dumps(serving)} if serving is not None else {}),
    }
    needed = storage.tensor_bytes(model_state)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with storage.guarded(out, ADVICE, needed):
        storage.ensure_room(out.parent, needed, ADVICE)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            ckpt.write_safetensors(tmp, model_state, metadata)
            tmp.replace(out)
        finally:
            tmp.unlink(missing_ok=True)
    return out, checkpoint.step


def _export_hf(config: dict[str, Any], serving: dict[str, Any] | None,
               model_state: dict[str, torch.Tensor], checkpoint: ckpt.Checkpoint,
               out: Path) -> None:
    """Rebuild the workload's model, load the weights and write it (``write_hf_export``)."""
    from gpuflow.serve.model import restore_workload

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; a Hugging Face export is a directory.")
    workload = restore_workload(config, model_state, checkpoint.path)
    needed = storage.tensor_bytes(model_state)
    with storage.guarded(out, ADVICE, needed):
        storage.ensure_room(out.parent, needed, ADVICE)
        write_hf_export(workload, config, checkpoint.step, out, serving)


def _with_adapters(config: dict[str, Any], spec: lora.LoraSpec,
                   adapters: dict[str, torch.Tensor], checkpoint: ckpt.Checkpoint,
                   serving: dict[str, Any] | None) -> Workload:
    """The run's workload rebuilt in fp32, its model the base (seeded as training seeded
    it, for a base of random weights) wrapped with the checkpoint's adapters. An NF4 base is
    quantized from the dtype the run quantized it from, so its codes are the trained ones."""
    from gpuflow.serve.model import build_workload

    torch.manual_seed(int(config.get("seed", 0)))
    workload = build_workload(config, serving=serving)
    autocast = autocast_dtype(str(config.get("precision", "fp32"))) if spec.quantize else None
    workload.model = lora.wrap(workload.model, spec, autocast)
    lora.load_adapters(workload.model, adapters, checkpoint.path)
    workload.model.eval()
    return workload


def _write_adapters(model: torch.nn.Module, out: Path) -> None:
    """PEFT's adapter files into ``out``, which appears whole or not at all."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; an adapter export is a directory.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        lora.save_adapters(model, tmp)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace_dir(tmp: Path, out: Path) -> None:
    """``tmp`` renamed to ``out``, the old ``out`` removed only once the new one is there."""
    old = out.with_name(f".{out.name}.old{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _byte_vocabulary(model: torch.nn.Module) -> bool:
    """Whether the model's tokens are the 256 bytes, as gpuflow's text workloads train
    language models, Hugging Face ones too: then its tokenizer maps id ``i`` to byte ``i``."""
    return getattr(getattr(model, "config", None), "vocab_size", None) == BYTE_VOCAB_SIZE


def write_hf_export(workload: Workload, config: dict[str, Any], step: int, out: Path,
                    serving: dict[str, Any] | None = None) -> None:
    """Let the workload write its model in the Hugging Face format into ``out``, which
    appears whole or not at all. ``RUN_CONFIG_FILE`` records the run's step, configuration
    and codec state, so that ``gpuflow serve`` can serve the directory. A model over bytes
    gets the byte tokenizer beside it if its writer saved none, so that the directory is
    whole for any tool that reads the format (``AutoTokenizer`` included)."""
    writer = workload.hf_writer()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        writer(workload.model, tmp)
        if _byte_vocabulary(workload.model) and not (tmp / "tokenizer.json").is_file():
            from gpuflow.models.gpt2_format import byte_tokenizer

            byte_tokenizer().save_pretrained(tmp)
        record = {"step": step, "config": config,
                  **({"serving": serving} if serving is not None else {})}
        (tmp / RUN_CONFIG_FILE).write_text(json.dumps(record, indent=2))
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
