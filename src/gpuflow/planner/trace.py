"""One training forward and backward of a workload's model, recorded for the planner.

The step runs on copies of the parameters, fake (``FakeTensorMode``: exact shapes, dtypes and
FLOPs, no memory used) or real. ``saved_tensors_hooks`` records every tensor autograd keeps
for backward; hooks on the repeated blocks and on the tensor-parallel plan's layers say which
of them a block, or a tensor-parallel shard, holds. A dispatch mode follows every storage the
ops allocate until it is freed: what the front end (everything before the first block) keeps
alive at once can exceed everything saved, as a speech model's spectrogram does once
autocast halves the rest.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from gpuflow.precision import autocast_dtype
from gpuflow.telemetry.flops import CUSTOM_FLOP_FORMULAS, call_with_state
from gpuflow.workload import Workload


@dataclass
class Trace:
    """One forward+backward: saved bytes by where they were saved, and FLOPs."""

    total: float = 0.0
    block: float = 0.0
    sharded: float = 0.0
    block_input: float = 0.0
    flops: float = 0.0
    output: float = 0.0
    before_blocks: float = 0.0
    front_peak: float = 0.0
    batch: float = 0.0
    # Each saved tensor's bytes and whether a block saved it, in the order they were saved.
    saved: list[tuple[float, bool]] = field(default_factory=list)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops allocate, counted from allocation until freed, and their
    running peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int, size: int) -> None:
        self.seen.discard(key)
        self.live -= size


class _SavedTensorRecorder:
    """Counts each storage autograd saves once, excluding the parameters' own storages."""

    def __init__(self, params: list[torch.Tensor], live: _LiveBytes) -> None:
        self.exclude = {_storage_key(p) for p in params}
        self.live = live
        self.seen: set[int] = set()
        self.in_block = 0
        self.blocks_started = False
        self.sharded = False
        self.trace = Trace()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self.exclude and key not in self.seen:
            self.seen.add(key)
            size = tensor.untyped_storage().nbytes()
            self.trace.total += size
            self.trace.saved.append((tensor.numel() * tensor.element_size(),
                                     bool(self.in_block)))
            if self.in_block:
                self.trace.block += size
                if self.sharded:
                    self.trace.sharded += size
            elif not self.blocks_started:
                self.trace.before_blocks += size
        return tensor

    def hooks(self, blocks: Sequence[nn.Module], plan: Mapping[str, Any] | None) -> list[Any]:
        """Block entry/exit, and the tensor-parallel region: from a column-wise layer's
        output to a row-wise layer's output activations are split across ranks."""
        handles = []
        for index, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(self._enter(index == 0)))
            handles.append(block.register_forward_hook(self._leave))
            for name, style in (plan or {}).items():
                layer = block.get_submodule(name)
                if isinstance(style, ColwiseParallel):
                    handles.append(layer.register_forward_hook(self._set_sharded(True)))
                elif isinstance(style, RowwiseParallel):
                    handles.append(layer.register_forward_hook(self._set_sharded(False)))
        return handles

    def _enter(self, first: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            self.in_block += 1
            if not self.blocks_started:
                self.trace.front_peak = self.live.peak
            self.blocks_started = True
            if first:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                self.trace.block_input = sum(t.untyped_storage().nbytes() for t in tensors[:1])
        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.in_block -= 1
        self.sharded = False

    def _set_sharded(self, value: bool) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.sharded = value
        return hook


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def map_tensors(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple | list):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


@contextlib.contextmanager
def _train_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)


def trace_step(workload: Workload, plan: Mapping[str, Any] | None, inputs: Any,
               target: torch.Tensor, precision: str, fake: bool, count_flops: bool = True,
               low_precision_params: bool = False) -> Trace:
    """One training forward+backward on copies of the parameters (fake or real), in the
    compute dtype where ``low_precision_params`` (except where FSDP keeps them fp32)."""
    from gpuflow.parallel.sharded import kept_in_fp32

    model = workload.model
    mode = (torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
            if fake else contextlib.nullcontext())
    fp32_params = {id(p) for module in kept_in_fp32(model) for p in module.parameters()}
    low = autocast_dtype(precision) if low_precision_params else None
    with mode, _train_mode(model):
        state: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            dtype = low if low is not None and id(param) not in fp32_params else param.dtype
            # Plain tensors, also for a tensor subclass (an NF4 base: its dtype is the one it
            # dequantizes to, and its own bytes are counted apart).
            state[name] = torch.zeros(param.shape, device="cpu", dtype=dtype).requires_grad_(
                param.requires_grad)
        for name, buffer in model.named_buffers():
            state[name] = (torch.empty_like(buffer, device="cpu") if fake
                           else buffer.detach().clone().cpu())
        inputs = map_tensors(inputs, lambda t: t.to("cpu") if not fake
                              else torch.zeros_like(t, device="cpu"))
        target = target.to("cpu") if not fake else torch.zeros_like(target, device="cpu")
        live = _LiveBytes()
        recorder = _SavedTensorRecorder(list(state.values()), live)
        handles = recorder.hooks(workload.blocks(), plan)
        counter = (flop_counter.FlopCounterMode(display=False,
                                                custom_mapping=CUSTOM_FLOP_FORMULAS)
                   if count_flops else None)
        dtype = autocast_dtype(precision)
        autocast = (torch.autocast("cpu", dtype=dtype) if dtype is not None
                    else contextlib.nullcontext())
        try:
            with counter or contextlib.nullcontext(), live:
                saving = torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t)
                with saving, autocast:
                    outputs = call_with_state(model, state, inputs)
                    loss = workload.loss_fn(outputs, target)
                if not recorder.blocks_started:
                    recorder.trace.front_peak = live.peak
                loss.backward()
        finally:
            for handle in handles:
                handle.remove()
    recorder.trace.flops = counter.get_total_flops() if counter is not None else 0.0
    recorder.trace.batch = float(sum(t.untyped_storage().nbytes() for t in
                                     torch.utils._pytree.tree_leaves((inputs, target))
                                     if isinstance(t, torch.Tensor)))
    recorder.trace.output = float(sum(
        t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(outputs)
        if isinstance(t, torch.Tensor)))
    return recorder.trace
