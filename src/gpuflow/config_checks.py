"""The checks of a training configuration: values in range, and options that only some
parallel layouts can use.

:class:`gpuflow.config_fields.TrainFields` declares the fields (this module names that type,
below :class:`gpuflow.config.TrainConfig`, which calls it); this module refuses what cannot
run (a UserError, exit code 2) before any process starts, and names the options a layout
would ignore. A layout option set away from its default for a layout that has no use for it is
refused when the layout was chosen with it; when the layout comes from the planner
(``--strategy auto``) or a resumed run's saved options, the run says so once and goes on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gpuflow.config_fields import TrainFields
from gpuflow.errors import UserError
from gpuflow.options import check_choices

# Why a captured CUDA graph cannot replay a step of each multi-process strategy.
_UNGRAPHABLE = {
    "ddp": "DDP all-reduces gradient buckets from autograd hooks while backward runs",
    "fsdp": "FSDP2 gathers, frees and allocates parameters around each block",
    "tp": "tensor parallelism runs collectives inside each block",
    "pp": "the pipeline schedule sends activations between ranks between micro-steps",
}

# The options of one strategy family, and what they tune.
LAYOUT_OPTIONS = {
    "bucket_mb": "ddp", "fsdp_prefetch": "fsdp", "fsdp_wrap": "fsdp",
    "reshard_after_forward": "fsdp", "pp_schedule": "pp", "microbatches": "pp",
    "pp_split": "pp",
}
_TUNED = {"ddp": "DDP's gradient buckets (--strategy ddp)",
          "fsdp": "FSDP's sharding (--strategy fsdp)",
          "pp": "the pipeline (--strategy pp, or --strategy fsdp with --pp N)"}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def check_values(config: TrainFields) -> None:
    """Reject values that would fail later with an unhelpful traceback."""
    check_choices(config)
    if config.batch_size != "auto" and config.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 or auto (got {config.batch_size}).")
    for name in ("grad_accum", "log_every", "keep_checkpoints",
                 "max_nonfinite_steps", "nproc", "nnodes", "tp", "pp", "loss_chunks"):
        if getattr(config, name) < 1:
            raise UserError(f"--{_flag(name)} must be at least 1 (got {getattr(config, name)}).")
    for name in ("eval_every", "eval_batches", "checkpoint_every", "num_workers",
                 "warmup_steps", "max_restarts", "node_rank"):
        if getattr(config, name) < 0:
            raise UserError(f"--{_flag(name)} must be 0 or more (got {getattr(config, name)}).")
    if config.lr <= 0:
        raise UserError(f"--lr must be positive (got {config.lr}).")
    if config.bucket_mb is not None and config.bucket_mb <= 0:
        raise UserError(f"--bucket-mb must be positive (got {config.bucket_mb}).")
    if config.fsdp_prefetch is not None and config.fsdp_prefetch < 1:
        raise UserError(f"--fsdp-prefetch must be at least 1 (got {config.fsdp_prefetch}); "
                        "leave it unset for FSDP's own one-block prefetch.")
    if config.max_steps is not None and config.max_steps < 1:
        raise UserError(f"--max-steps must be at least 1 (got {config.max_steps}).")
    if config.ema_decay is not None and not 0.0 <= config.ema_decay < 1.0:
        raise UserError(f"--ema-decay must be in [0, 1) (got {config.ema_decay}); 0.99 "
                        "averages about the last 100 steps, off turns averaging off.")
    if config.epochs is not None and config.epochs <= 0:
        raise UserError(f"--epochs must be positive (got {config.epochs}).")
    if config.max_steps is not None and config.epochs is not None:
        raise UserError("Give either --max-steps or --epochs, not both.")
    if config.checkpoint_every and not config.save_checkpoints:
        raise UserError("--checkpoint-every and --no-checkpoints contradict each other; "
                        "drop one.")
    if config.max_restarts and not config.save_checkpoints:
        raise UserError("--max-restarts resumes restarted workers from the last "
                        "checkpoint, which --no-checkpoints never writes; drop one.")
    if config.clip_grad is not None and config.clip_grad <= 0:
        raise UserError(f"--clip-grad must be positive (got {config.clip_grad}).")
    if config.memory_cap_gib is not None and config.memory_cap_gib <= 0:
        raise UserError(f"--memory-cap-gib must be positive (got {config.memory_cap_gib}).")
    for name in ("dp", "microbatches", "global_batch"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise UserError(f"--{_flag(name)} must be at least 1 (got {value}).")
    if config.compile_scope == "model" and not (config.compile or config.cuda_graphs
                                                or config.precision == "fp8"):
        raise UserError("--compile-scope model says what --compile compiles, and this run "
                        "compiles nothing: add --compile, or drop --compile-scope.")
    if config.fp8_min_features is not None and config.precision != "fp8":
        raise UserError("--fp8-min-features chooses the layers --precision fp8 converts: add "
                        "--precision fp8, or drop --fp8-min-features.")
    if config.fp8_min_features is not None and config.fp8_min_features < 0:
        raise UserError(f"--fp8-min-features must be 0 or more, or auto (got "
                        f"{config.fp8_min_features}).")
    check_lora_values(config)


def check_lora_values(config: TrainFields) -> None:
    """The LoRA flags: in range, and only beside --lora-rank."""
    if config.lora_rank is None:
        if config.quantize_base is not None:
            raise UserError(f"--quantize-base {config.quantize_base} holds the frozen base of "
                            "a LoRA run in 4 bits (QLoRA), and only --lora-rank R freezes it: "
                            "add --lora-rank, or drop --quantize-base.")
        given = [f"--{_flag(name)}" for name, default in
                 (("lora_alpha", None), ("lora_dropout", 0.0), ("lora_targets", "all-linear"))
                 if getattr(config, name) != default]
        if given:
            raise UserError(f"{', '.join(given)} tune{'s' * (len(given) == 1)} LoRA adapters, "
                            "which only --lora-rank R turns on: add it, or drop them.")
        return
    if config.lora_rank < 1:
        raise UserError(f"--lora-rank must be at least 1 (got {config.lora_rank}).")
    if config.lora_alpha is not None and config.lora_alpha <= 0:
        raise UserError(f"--lora-alpha must be positive (got {config.lora_alpha}).")
    if not 0.0 <= config.lora_dropout < 1.0:
        raise UserError(f"--lora-dropout must be in [0, 1) (got {config.lora_dropout}).")
    if config.precision == "fp8":
        raise UserError("--lora-rank with --precision fp8: float8 training converts the "
                        "linear layers the adapters attach to. Use --precision bf16.")


def check_lora_layout(strategy: str, tp: int, pp: int, quantize: str | None = None) -> None:
    """Refuse a layout adapters do not train under (:func:`lora_layout_refusal`)."""
    refusal = lora_layout_refusal(strategy, tp, pp, quantize)
    if refusal is not None:
        raise UserError(refusal)


def lora_layout_refusal(strategy: str, tp: int, pp: int, quantize: str | None = None
                        ) -> str | None:
    """Why adapters do not train under this layout; None where they do (the planner offers
    only those). Adapters train under single, ddp and fsdp; tensor and pipeline parallelism
    would have to split the adapters as they split their base layers, which gpuflow does
    not. An NF4 base trains on one device or sharded by FSDP2 (``nf4.check_shards``): 2 DDP
    ranks of it do not follow one process."""
    if quantize and strategy not in ("single", "fsdp"):
        return (f"--quantize-base {quantize} trains under --strategy single and fsdp (this "
                f"run: --strategy {strategy}): 2 DDP ranks of an NF4 base do not follow one "
                "process. Use --strategy fsdp, which shards the NF4 base over the ranks.")
    if strategy in ("tp", "pp") or tp > 1 or pp > 1:
        return (f"--lora-rank trains under --strategy single, ddp and fsdp (this run: "
                f"--strategy {strategy}{f' --tp {tp}' if tp > 1 else ''}"
                f"{f' --pp {pp}' if pp > 1 else ''}): tensor and pipeline parallelism do "
                "not split the adapters beside their layers.")
    return None


def check_step_modes(config: TrainFields, strategy: str, tp: int, pp: int) -> None:
    """fp8, CUDA graphs and whole-model compile only with the strategies they compose
    with."""
    if config.compile_scope == "model" and strategy == "fsdp":
        raise UserError(
            "--compile-scope model with --strategy fsdp: FSDP2 gathers and frees each "
            "block's parameters in hooks that torch.compile leaves out of its graphs, so a "
            "whole-model graph would break at every block. Use --compile-scope block (the "
            "default) under fsdp.")
    if config.precision == "fp8" and (tp > 1 or pp > 1 or strategy in ("tp", "pp")):
        raise UserError(
            "--precision fp8 composes with --strategy single, ddp and fsdp; tensor and "
            "pipeline parallelism would need torchao's float8 parallel styles, which "
            f"gpuflow does not apply (this run: --strategy {strategy}"
            f"{f' --tp {tp}' if tp > 1 else ''}{f' --pp {pp}' if pp > 1 else ''}). Use "
            "--precision bf16 with them.")
    if config.cuda_graphs and (config.grad_accum > 1 or config.batch_size == "auto"):
        asked = ("--batch-size auto, which may accumulate micro-batches" if
                 config.batch_size == "auto" else f"--grad-accum {config.grad_accum}")
        raise UserError(
            f"--cuda-graphs with {asked}: the captured backward writes each micro-step's "
            "gradients into memory that the next replay reuses (torch's cudagraph trees), "
            "so they cannot accumulate. Use --grad-accum 1 and a --batch-size N.")
    if config.cuda_graphs and strategy != "single":
        raise UserError(
            f"--cuda-graphs runs with --strategy single only: with --strategy {strategy}, "
            f"{_UNGRAPHABLE[strategy]}, which one captured graph cannot replay. Drop "
            "--cuda-graphs, or train on one GPU.")


def idle_layout_options(config: TrainFields, strategy: str, pp: int) -> dict[str, str]:
    """The layout options set away from their defaults that ``strategy`` with ``pp``
    pipeline stages does not use: each one's flag as given (``--bucket-mb 4``) by its
    family (``ddp``, ``fsdp`` or ``pp``)."""
    families = {strategy, *(("pp",) if pp > 1 else ())}
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    idle = {}
    for name, family in LAYOUT_OPTIONS.items():
        value: Any = getattr(config, name)
        if family in families or value == defaults[name]:
            continue
        idle[_given(name, value)] = family
    return idle


def _given(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"--{'' if value else 'no-'}{_flag(name)}"
    return f"--{_flag(name)} {value:g}" if isinstance(value, float) else f"--{_flag(name)} {value}"


def describe_idle(idle: dict[str, str], layout: str) -> str:
    """What the idle options tune, and that this run's ``layout`` has none of it."""
    tuned = [f"{', '.join(f for f, fam in idle.items() if fam == family)} "
             f"tune{'s' * (list(idle.values()).count(family) == 1)} {_TUNED[family]}"
             for family in _TUNED if family in idle.values()]
    return f"{'; '.join(tuned)}, which this run ({layout}) does not have"


def check_layout(config: TrainFields, strategy: str, chosen: bool) -> None:
    """Refuse fp8 and CUDA graphs with a layout they do not compose with, and options that
    tune another layout. ``chosen``: the strategy was given, rather than the default for the
    job's size; one process may then still be a rank of an outside launcher's job, so
    ``--bucket-mb`` is left to the run's warning."""
    if config.precision == "fp8" or config.cuda_graphs or config.compile_scope == "model":
        check_step_modes(config, strategy, config.tp, config.pp)
    if config.lora_rank is not None:
        check_lora_layout(strategy, config.tp, config.pp, config.quantize_base)
    if config.resume:
        return  # the saved options may be another layout's: the run warns of them
    idle = idle_layout_options(config, strategy, config.pp)
    if not chosen and config.nproc * config.nnodes == 1:
        idle = {flag: family for flag, family in idle.items() if family != "ddp"}
    if idle:
        one = len(idle) == 1
        raise UserError(f"{describe_idle(idle, f'--strategy {strategy}')}: drop "
                        f"{'it' if one else 'them'}, or choose the layout "
                        f"{'it tunes' if one else 'they tune'}.")
