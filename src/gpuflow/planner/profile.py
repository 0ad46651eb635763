"""What the planner knows about a model: parameters, FLOPs and saved activations per sample.

A workload's model is profiled by running one forward and backward of its example batch on
fake tensors (``FakeTensorMode``): shapes, dtypes and FLOPs are exact and no memory is used, so
a model built on the meta device (a 1B GPT on a laptop) profiles as cheaply as a small one.
``saved_tensors_hooks`` records every tensor autograd keeps for backward; hooks on the
repeated blocks and on the tensor-parallel plan's layers say which of them a block, or a
tensor-parallel shard, holds. A dispatch mode follows every storage the ops allocate until it
is freed: what the front end (everything before the first block) keeps alive at once can
exceed everything saved, as a speech model's spectrogram does once autocast halves the
rest. Tracing at batch 1 and 2 separates what grows with the batch
from what does not (low-precision copies of the weights); a token model is traced at the
sequence length asked for (its example cut shorter), since fake tensors of any length are free.

A transformer can also be described by its dimensions alone (:class:`TransformerDims`), for
models gpuflow does not build, such as Llama 3.1 8B.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from gpuflow.errors import UserError
from gpuflow.precision import autocast_dtype
from gpuflow.telemetry.flops import CUSTOM_FLOP_FORMULAS, call_with_state
from gpuflow.workload import Workload


def tensor_parallel_plan(workload: Workload) -> Any:
    """The plan ``--strategy tp`` would apply (a Hugging Face model's own included), or None
    where there is none to plan with."""
    try:
        return workload.parallel_plan()
    except UserError:
        return None


@dataclass(frozen=True)
class ModelProfile:
    """Per-sample figures of one model in one precision; bytes unless named otherwise."""

    name: str
    precision: str
    params: int
    block_params: int
    tp_params: int
    layers: int
    flops_per_sample: float
    act_per_sample: float
    act_block_per_sample: float
    act_tp_per_sample: float
    block_input_per_sample: float
    # Backward's largest excess over what forward saved: an op's backward holds the
    # gradients of its output and its input (twice its saved tensor) when everything saved
    # after it has been freed already. A front end's large tensors count less than a loss's.
    backward_excess_per_sample: float
    act_const: float
    tokens_per_sample: int | None
    source: str
    # The model's output (e.g. the logits): a pipeline's last stage keeps it for every
    # micro-batch of the step.
    output_per_sample: float = 0.0
    # Saved before the first block (e.g. the embedding's token ids): a pipeline's first stage
    # holds these, its last stage the rest of what lies outside the blocks.
    act_before_blocks_per_sample: float = 0.0
    # The most the front end (forward up to the first block) holds alive at once, saved or
    # not; and the micro-batch itself (inputs and target), which the step keeps throughout.
    front_peak_per_sample: float = 0.0
    batch_per_sample: float = 0.0
    # The largest tensor a block saves: checkpointing's recompute holds its gradients.
    largest_block_saved_per_sample: float = 0.0
    # The same model traced with its parameters in the compute dtype, as FSDP's mixed
    # precision gathers them (what flows between layers can then be low precision too);
    # None in fp32, or for this variant itself.
    with_low_precision_params: ModelProfile | None = None


# --- tracing ---------------------------------------------------------------------------------


@dataclass
class _Trace:
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
        self.trace = _Trace()

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

    def hooks(self, workload: Workload) -> list[Any]:
        """Block entry/exit, and the tensor-parallel region: from a column-wise layer's
        output to a row-wise layer's output activations are split across ranks."""
        handles = []
        blocks = workload.blocks()
        for index, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(self._enter(index == 0)))
            handles.append(block.register_forward_hook(self._leave))
            for name, style in (tensor_parallel_plan(workload) or {}).items():
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


def _map_tensors(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple | list):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


@contextlib.contextmanager
def _train_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)


def _trace_once(workload: Workload, inputs: Any, target: torch.Tensor, precision: str,
                fake: bool, count_flops: bool = True, low_precision_params: bool = False
                ) -> _Trace:
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
            state[name] = torch.zeros_like(param, device="cpu", dtype=dtype).requires_grad_(
                param.requires_grad)
        for name, buffer in model.named_buffers():
            state[name] = (torch.empty_like(buffer, device="cpu") if fake
                           else buffer.detach().clone().cpu())
        inputs = _map_tensors(inputs, lambda t: t.to("cpu") if not fake
                              else torch.zeros_like(t, device="cpu"))
        target = target.to("cpu") if not fake else torch.zeros_like(target, device="cpu")
        live = _LiveBytes()
        recorder = _SavedTensorRecorder(list(state.values()), live)
        handles = recorder.hooks(workload)
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


def _rows(value: Any, count: int, seq: int | None) -> Any:
    """The first example repeated ``count`` times, cut to ``seq`` tokens if given."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        rows = t[:1] if seq is None else t[:1, :seq]
        return rows.repeat(count, *[1] * (t.dim() - 1))
    return _map_tensors(value, cut)


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


def profile_workload(workload: Workload, precision: str = "fp32",
                     seq_len: int | None = None, low_precision_params: bool = False,
                     fsdp: bool = True) -> ModelProfile:
    """Profile ``workload``'s model in ``precision``, optionally at a shorter ``seq_len``.

    Fake tensors cost nothing whatever their size, so the trace runs at the real sequence
    length; the batch is traced at 1 and 2 samples and the difference is one sample's share.
    A model fake tensors cannot run is traced for real on the CPU (if it is not on meta).
    In bf16/fp16 the model is traced a second time with its parameters in that dtype, for
    FSDP's layouts, unless ``fsdp`` is False (one device: no FSDP layout will be asked for).
    """
    inputs, target = workload.get_example_batch()
    _check_seq(workload, inputs, seq_len)
    params = {id(p): p for p in workload.model.parameters()}

    def trace(count: int, fake: bool) -> _Trace:
        return _trace_once(workload, _rows(inputs, count, seq_len),
                           _rows(target, count, seq_len), precision, fake,
                           count_flops=count == 2 and not low_precision_params,
                           low_precision_params=low_precision_params)

    fake = True
    try:
        one, two = trace(1, fake), trace(2, fake)
    except Exception:
        if any(p.is_meta for p in params.values()):
            raise
        fake = False
        one, two = trace(1, fake), trace(2, fake)
    per_sample = _Trace(**{f.name: getattr(two, f.name) - getattr(one, f.name)
                           for f in fields(_Trace) if f.name != "saved"})
    block_ids = {id(p) for block in workload.blocks() for p in block.parameters()}
    tp_ids = {id(p) for block in workload.blocks()
              for name, style in (tensor_parallel_plan(workload) or {}).items()
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
        source=f"traced ({'fake tensors' if fake else 'real CPU tensors'})",
        output_per_sample=per_sample.output,
        act_before_blocks_per_sample=per_sample.before_blocks,
        front_peak_per_sample=per_sample.front_peak,
        batch_per_sample=per_sample.batch,
        largest_block_saved_per_sample=_largest_block_saved_per_sample(one.saved, two.saved),
        # The same FLOPs either way: counted once.
        with_low_precision_params=(
            replace(profile_workload(workload, precision, seq_len, low_precision_params=True),
                    flops_per_sample=two.flops / 2)
            if fsdp and autocast_dtype(precision) is not None and not low_precision_params
            else None),
    )


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


# --- a transformer described by its dimensions ------------------------------------------------


@dataclass(frozen=True)
class TransformerDims:
    """A decoder-only transformer by its dimensions, profiled analytically.

    ``gated`` MLPs (SwiGLU) have three matrices, plain ones two; ``kv_heads`` < ``heads`` is
    grouped-query attention. Attention is assumed to be a fused (flash) kernel that saves
    q, k, v, its output and a log-sum-exp, never the T x T scores.
    """

    layers: int
    dim: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn: int | None = None
    gated: bool = False
    tied: bool = True
    bias: bool = True
    learned_pos: bool = True
    name: str = "transformer"

    @property
    def kv_dim(self) -> int:
        return self.dim // self.heads * (self.kv_heads or self.heads)

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.dim

    def parameters(self) -> tuple[int, int, int]:
        """(all, in blocks, split by tensor parallelism)."""
        d, f, kv, v = self.dim, self.ffn_dim, self.kv_dim, self.vocab
        b = int(self.bias)
        norms = 2 * d * (1 + b)
        attn = d * (d + 2 * kv) + b * (d + 2 * kv) + d * d + b * d
        mlp = (3 if self.gated else 2) * d * f + b * (f + d)
        tp = d * (d + 2 * kv) + b * (d + 2 * kv) + d * d + (3 if self.gated else 2) * d * f + b * f
        block = norms + attn + mlp
        outer = v * d + (self.seq * d if self.learned_pos else 0) + d * (1 + b)
        outer += 0 if self.tied else v * d
        return outer + self.layers * block, self.layers * block, self.layers * tp

    def profile(self, precision: str) -> ModelProfile:
        """Saved bytes per token: fp32 residual stream and norm inputs, the rest in the
        compute dtype (autocast), a log-sum-exp per head, int64 tokens and targets, and
        the fp32 log-softmax of the logits."""
        d, f, kv, t = self.dim, self.ffn_dim, self.kv_dim, self.seq
        a = 2 if autocast_dtype(precision) is not None else 4
        r = 4
        mlp = (4 if self.gated else 2) * f
        # q, k, v; the attention output (laid out so the output projection reads it in
        # place); the MLP's hidden activations.
        sharded = a * ((d + 2 * kv) + d + mlp) + 4 * self.heads
        per_layer = 2 * r * d + a * (2 * d) + sharded
        outer = 16 + r * d + a * d + 4 * self.vocab
        total, block, tp = self.parameters()
        matmul = block - self.layers * (2 * d * (1 + int(self.bias)))
        head = self.vocab * d
        flops = 6 * (matmul + head) * t + 12 * self.layers * d * t * t
        const = 0.0 if a == 4 else a * (matmul + head)
        return ModelProfile(
            name=self.name, precision=precision, params=total, block_params=block,
            tp_params=tp, layers=self.layers, flops_per_sample=float(flops),
            act_per_sample=float(t * (self.layers * per_layer + outer)),
            act_block_per_sample=float(t * self.layers * per_layer),
            act_tp_per_sample=float(t * self.layers * sharded),
            block_input_per_sample=float(t * r * d),
            # Twice the fp32 logits, which the loss saves last; or twice the last block's MLP
            # hidden, less what is saved after it (about all of `outer`).
            backward_excess_per_sample=float(t * max(8 * self.vocab, 2 * a * f - outer)),
            largest_block_saved_per_sample=float(t * a * f), act_const=const,
            tokens_per_sample=t, source="analytic (dimensions)",
            output_per_sample=float(t * a * self.vocab),
            act_before_blocks_per_sample=float(8 * t),  # the embedding saves the token ids
            batch_per_sample=float(16 * t),  # int64 tokens and targets
            front_peak_per_sample=float(t * 2 * r * d),  # token embeddings, plus positions
        )


TRANSFORMER_PRESETS: dict[str, TransformerDims] = {
    # Llama 3.1 8B (Meta's model card / params.json): 32 x 4096, 32 heads, 8 KV heads,
    # SwiGLU 14336, vocabulary 128256, untied head, RoPE, no biases; torchtitan trains at 8192.
    "llama3-8b": TransformerDims(layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336,
                                 vocab=128256, seq=8192, gated=True, tied=False, bias=False,
                                 learned_pos=False, name="llama3-8b"),
}
DIM_KEYS = {"layers": int, "dim": int, "heads": int, "kv_heads": int, "ffn": int,
            "vocab": int, "seq": int, "gated": bool, "tied": bool, "bias": bool}


def parse_transformer(spec: str) -> TransformerDims:
    """``llama3-8b``, or ``layers=32,dim=4096,heads=32,vocab=128256,seq=8192[,...]``,
    or a preset followed by overrides (``llama3-8b,seq=4096``)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    base: TransformerDims | None = None
    if parts and "=" not in parts[0]:
        name = parts.pop(0)
        if name not in TRANSFORMER_PRESETS:
            raise UserError(f"--transformer: unknown preset {name!r}; known: "
                            f"{', '.join(TRANSFORMER_PRESETS)}, or give dimensions.")
        base = TRANSFORMER_PRESETS[name]
    values: dict[str, Any] = {}
    for part in parts:
        key, _, raw = part.partition("=")
        if key not in DIM_KEYS:
            raise UserError(f"--transformer: unknown key {key!r}; keys: {', '.join(DIM_KEYS)}.")
        kind = DIM_KEYS[key]
        try:
            values[key] = raw.lower() in ("1", "true", "yes") if kind is bool else kind(raw)
        except ValueError:
            raise UserError(f"--transformer: {key}={raw!r} is not a {kind.__name__}.") from None
    if base is not None:
        return replace(base, **values)
    missing = [k for k in ("layers", "dim", "heads", "vocab", "seq") if k not in values]
    if missing:
        raise UserError(f"--transformer needs {', '.join(missing)} (or a preset: "
                        f"{', '.join(TRANSFORMER_PRESETS)}).")
    return TransformerDims(**values)
