"""A workload's model profiled from traces of one training step (``gpuflow.planner.trace``).

Fake tensors cost nothing whatever their size, so a model built on the meta device (a 1B
GPT on a laptop) profiles as cheaply as a small one, at the sequence length asked for (its
example cut shorter). Tracing at batch 1 and 2 separates what grows with the batch from what
does not (low-precision copies of the weights). A model fake tensors cannot run is traced on
real CPU tensors instead, and a warning says so, since that costs the model's real memory
and time.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from gpuflow.errors import UserError
from gpuflow.planner.profile import ModelProfile
from gpuflow.planner.trace import Trace, map_tensors, trace_step
from gpuflow.precision import autocast_dtype
from gpuflow.workload import Workload


def tensor_parallel_plan(workload: Workload) -> Any:
    """The plan ``--strategy tp`` would apply (a Hugging Face model's own included), or None
    where there is none to plan with."""
    try:
        return workload.parallel_plan()
    except UserError:
        return None


def _rows(value: Any, count: int, seq: int | None) -> Any:
    """The first example repeated ``count`` times, cut to ``seq`` tokens if given."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        rows = t[:1] if seq is None else t[:1, :seq]
        return rows.repeat(count, *[1] * (t.dim() - 1))
    return map_tensors(value, cut)


def _check_seq(workload: Workload, inputs: Any, seq_len: int | None) -> None:
    if seq_len is None:
        return
    tokens = workload.tokens_per_sample
    if tokens is None or not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
        raise UserError(f"--seq-len: workload {workload.name!r} has no [batch, tokens] input "
                        "whose length the planner could change.")
    if seq_len > inputs.shape[1]:
        raise UserError(f"--seq-len {seq_len} is longer than {workload.name!r}'s context "
                        f"({inputs.shape[1]} tokens); choose a model with a longer one "
                        "(e.g. textlm --model-size 124m,seq=2048).")


class _Tracer:
    """Traces of one workload at batch 1 and 2, on fake tensors until they fail once."""

    def __init__(self, workload: Workload, precision: str, seq_len: int | None) -> None:
        self.workload, self.precision, self.seq_len = workload, precision, seq_len
        self.inputs, self.target = workload.get_example_batch()
        _check_seq(workload, self.inputs, seq_len)
        self.plan = tensor_parallel_plan(workload)
        self.fake = True

    def _trace(self, count: int, low_precision_params: bool) -> Trace:
        return trace_step(self.workload, self.plan, _rows(self.inputs, count, self.seq_len),
                          _rows(self.target, count, self.seq_len), self.precision, self.fake,
                          count_flops=count == 2 and not low_precision_params,
                          low_precision_params=low_precision_params)

    def traces(self, low_precision_params: bool) -> tuple[Trace, Trace]:
        if self.fake:
            try:
                return self._trace(1, low_precision_params), self._trace(2, low_precision_params)
            except Exception as exc:
                if any(p.is_meta for p in self.workload.model.parameters()):
                    raise
                self.fake = False
                reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
                warnings.warn(
                    f"The planner cannot trace {self.workload.name!r}'s model on fake tensors "
                    f"({reason}); it traces one training step of it on real CPU tensors "
                    "instead, at batch 1 and 2, which allocates the model's weights, "
                    "activations and gradients for real and takes as long as those steps do.",
                    stacklevel=4)
        return self._trace(1, low_precision_params), self._trace(2, low_precision_params)

    def profile(self, low_precision_params: bool = False) -> ModelProfile:
        one, two = self.traces(low_precision_params)
        return _profile_of(self.workload, self.plan, self.precision, self.seq_len, one, two,
                           "fake tensors" if self.fake else "real CPU tensors")


def profile_workload(workload: Workload, precision: str = "fp32",
                     seq_len: int | None = None, fsdp: bool = True) -> ModelProfile:
    """Profile ``workload``'s model in ``precision``, optionally at a shorter ``seq_len``.

    The batch is traced at 1 and 2 samples and the difference is one sample's share. A model
    fake tensors cannot run is traced for real on the CPU (if it is not on meta), with a
    warning. In bf16/fp16 the model is traced a second time with its parameters in that
    dtype, for FSDP's layouts, unless ``fsdp`` is False (one device: no FSDP layout will be
    asked for).
    """
    tracer = _Tracer(workload, precision, seq_len)
    profile = tracer.profile()
    if not fsdp or autocast_dtype(precision) is None:
        return profile
    # The same FLOPs either way: counted once.
    low = replace(tracer.profile(low_precision_params=True),
                  flops_per_sample=profile.flops_per_sample)
    return replace(profile, with_low_precision_params=low)


def _profile_of(workload: Workload, plan: Mapping[str, Any] | None, precision: str,
                seq_len: int | None, one: Trace, two: Trace, traced_on: str) -> ModelProfile:
    """The profile from traces at batch 1 and 2."""
    params = {id(p): p for p in workload.model.parameters()}
    per_sample = Trace(**{f.name: getattr(two, f.name) - getattr(one, f.name)
                          for f in fields(Trace) if f.name != "saved"})
    block_ids = {id(p) for block in workload.blocks() for p in block.parameters()}
    tp_ids = {id(p) for block in workload.blocks()
              for name, style in (plan or {}).items()
              if isinstance(style, ColwiseParallel | RowwiseParallel)
              for p in block.get_submodule(name).parameters()
              if not (isinstance(style, RowwiseParallel) and p.dim() == 1)}
    return ModelProfile(
        name=workload.name, precision=precision,
        params=sum(p.numel() for p in params.values()),
        block_params=sum(p.numel() for i, p in params.items() if i in block_ids),
        tp_params=sum(p.numel() for i, p in params.items() if i in tp_ids),
        layers=len(workload.blocks()),
        flops_per_sample=two.flops / 2,
        act_per_sample=per_sample.total,
        act_block_per_sample=per_sample.block,
        act_tp_per_sample=per_sample.sharded,
        block_input_per_sample=two.block_input / 2,
        backward_excess_per_sample=_backward_excess_per_sample(one.saved, two.saved),
        act_const=one.total - per_sample.total,
        tokens_per_sample=seq_len or workload.tokens_per_sample,
        trained_params=sum(p.numel() for p in params.values() if p.requires_grad),
        frozen_bytes=sum(held_bytes(p) for p in params.values() if not p.requires_grad),
        source=f"traced ({traced_on})",
        output_per_sample=per_sample.output,
        act_before_blocks_per_sample=per_sample.before_blocks,
        front_peak_per_sample=per_sample.front_peak,
        batch_per_sample=per_sample.batch,
        largest_block_saved_per_sample=_largest_block_saved_per_sample(one.saved, two.saved),
    )


def held_bytes(param: torch.Tensor) -> int:
    """The bytes a parameter holds: those of the tensors inside a tensor subclass (an NF4
    weight's codes and scales), else its elements'."""
    if is_traceable_wrapper_subclass(param):
        names, _ = param.__tensor_flatten__()
        return sum(held_bytes(getattr(param, name)) for name in names)
    return param.numel() * param.element_size()


def _per_sample_sizes(one: list[tuple[float, bool]], two: list[tuple[float, bool]]
                      ) -> list[tuple[float, bool]]:
    """Each saved tensor's growth per sample, in save order, and whether a block saved it.
    Both traces save the same tensors in the same order, so pairing them separates what
    scales with the batch from what does not: under autocast a weight's low-precision copy
    can outsize every activation at batch 1. Unpaired, half of the batch-2 sizes."""
    if len(one) != len(two):
        return [(size / 2, in_block) for size, in_block in two]
    return [(b - a, in_block) for (a, _), (b, in_block) in zip(one, two, strict=True)]


def _largest_block_saved_per_sample(one: list[tuple[float, bool]],
                                    two: list[tuple[float, bool]]) -> float:
    """The growth per sample of the largest tensor a block saves."""
    return max((size for size, in_block in _per_sample_sizes(one, two) if in_block),
               default=0.0)


def _backward_excess_per_sample(one: list[tuple[float, bool]],
                                two: list[tuple[float, bool]]) -> float:
    """Per sample, the most that backward holds beyond forward's saved tensors: at the op
    that saved tensor k, twice its size, less all saved after k (freed by then)."""
    excess, after = 0.0, 0.0
    for size, _ in reversed(_per_sample_sizes(one, two)):
        excess = max(excess, 2 * size - after)
        after += size
    return excess
