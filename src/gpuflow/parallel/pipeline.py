"""Pipeline parallelism with ``torch.distributed.pipelining``.

The model is traced once (``pipeline()``, torch.export underneath) and cut at the beginning
of evenly spaced repeated blocks, so any workload whose forward exports can be pipelined
without touching its code. A model that torch.export cannot trace is cut at the same
blocks by hand instead (``gpuflow.parallel.stages``: module copies in
``PipelineStage``s). Each rank keeps its stage(s) and a schedule (GPipe, 1F1B or
interleaved 1F1B with two stages per rank) moves micro-batches between them.

Parameters used by more than one stage (a language model's head tied to its embedding)
are copied into each stage by the tracer; their gradients are summed across the pipeline
before the optimizer step, so the copies stay identical, as the tie would keep them.
Checkpoints use the original parameter names, so a pipelined run saves and loads the same
full state as any other strategy.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    SplitPoint,
    pipeline,
)
from torch.distributed.tensor import DTensor

from gpuflow.errors import UserError
from gpuflow.parallel import stages as manual
from gpuflow.parallel.dims import stages_per_rank
from gpuflow.parallel.pipeline_state import (
    PART_PREFIX,
    StageNames,
    StageParts,
    load_state,
    state_to_load,
    state_to_save,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def _sample_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int, ...]]:
    """Each input tensor's shape without its batch dimension."""
    return [tuple(t.shape[1:]) for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)]


def _as_call(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch's inputs as arguments, by ``gpuflow.workload.call_model``'s rule."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    return (inputs,), {}


class Pipeline:
    """This rank's share of a pipelined model and the schedule that drives it."""

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], example_inputs: Any,
                 mesh: DeviceMesh, schedule: str, microbatches: int,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 device: torch.device, split: str = "auto") -> None:
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.group = mesh.get_group()
        self.microbatches = microbatches
        self._loss_fn = self._step_loss = loss_fn
        self._loss_scale = 1.0
        self._losses: list[torch.Tensor] = []
        self.canonical = _canonical_names(model)
        self.block_names = _block_names(model, blocks)
        self._tied_shapes = {name: param.shape for name, param in model.named_parameters()}

        total_stages = self.size * stages_per_rank(schedule)
        split_spec = _split_points(self.block_names, total_stages)
        local = list(range(self.rank, total_stages, self.size))
        args, kwargs = _as_call(example_inputs)
        self._sample_shapes = _sample_shapes(args, kwargs)
        self.manual = split == "manual"
        if not self.manual:
            try:
                pipe = self._traced(model, args, kwargs, split_spec)
                self.stages = [pipe.build_stage(index, device, group=self.group)
                               for index in local]
                self._tied = self._tied_copies(pipe.replicated_params, local)
            except UserError:
                raise
            except Exception as exc:
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0].split('. ')[0]}"
                if split == "trace":
                    raise UserError(
                        f"Pipeline parallelism traces the model with torch.export, and tracing "
                        f"failed ({reason}). Make the forward exportable (no data-dependent "
                        "Python control flow), use --pp-split manual, or use fsdp/tp.") from None
                warnings.warn(f"The model's traced pipeline split is unusable ({reason}); "
                              "cutting it into pipeline stages at its repeated blocks instead "
                              "(--pp-split manual).", stacklevel=2)
                self.manual = True
        if self.manual:
            parts = manual.build_manual_stages(model, self.block_names, total_stages, local,
                                               manual.as_keywords(example_inputs))
            self.stages = [PipelineStage(part, index, total_stages, device, group=self.group)
                           for part, index in zip(parts, local, strict=True)]
            self._tied = [(name, [(part, f"{manual.STAGE_MODEL}.{name}") for part in parts])
                          for name in manual.shared_parameter_names(model, self.block_names)]
        self.first = 0 in local
        self.last = total_stages - 1 in local
        self.parts = StageParts([stage.submod for stage in self.stages])
        self.names = StageNames(self.canonical, self.manual)
        # (data-parallel size, rank) once FSDP shards the stages: tied gradients are shards.
        self.grad_shards: tuple[int, int] | None = None
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                          "interleaved-1f1b": ScheduleInterleaved1F1B}[schedule]
        stage_arg: Any = self.stages if schedule == "interleaved-1f1b" else self.stages[0]
        self.schedule = schedule_class(stage_arg, microbatches, loss_fn=self._scaled_loss,
                                       scale_grads=False)
        self._last_rank = (total_stages - 1) % self.size

    @staticmethod
    def _traced(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                split_spec: dict[str, SplitPoint]) -> Any:
        with warnings.catch_warnings():
            # torch's own tracing machinery warns about its own deprecated pytree calls.
            warnings.filterwarnings("ignore", ".*LeafSpec", FutureWarning)
            pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                            split_spec=split_spec)
        _check_input_order(pipe.split_gm.graph)
        return pipe

    def blocks_of(self, stage: Any) -> list[nn.Module]:
        """The repeated blocks inside one of this rank's stages (for FSDP and checkpointing)."""
        if isinstance(stage.submod, manual.ManualStage):
            return stage.submod.owned_blocks()
        found = []
        for name in self.block_names:
            try:
                found.append(stage.submod.get_submodule(name))
            except AttributeError:
                continue
        return found

    def _tied_copies(self, replicated: list[dict[str, str]], local: list[int]
                     ) -> list[tuple[str, list[tuple[nn.Module, str]]]]:
        """For each parameter the tracer copied into several stages: its name, and where
        this rank holds copies (none on a middle stage). Looked up by name at each use,
        since FSDP replaces the parameter objects."""
        by_index = dict(zip(local, self.stages, strict=True))
        tied = []
        for mapping in replicated:
            name = self.canonical[next(iter(mapping.values()))]
            copies = [(by_index[_stage_index(submod)].submod, fqn)
                      for submod, fqn in mapping.items() if _stage_index(submod) in by_index]
            tied.append((name, copies))
        return tied

    def _outputs(self, flat: Any) -> Any:
        """The model's outputs as the loss and metrics expect them (a manual last stage
        hands the schedule tensors only)."""
        if not self.manual:
            return flat
        return self.stages[-1].submod.layout.rebuild(flat)

    def _scaled_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        loss = self._step_loss(self._outputs(output), target)
        self._losses.append(loss.detach())
        return loss * self._loss_scale

    # --- steps --------------------------------------------------------------------------

    def forward_backward(self, inputs: Any, target: torch.Tensor, scale: float,
                         loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
                         ) -> torch.Tensor:
        """Run one batch through the schedule; gradients accumulate scaled by ``scale`` /
        micro-batches. ``loss_fn`` (the model's own by default) is called once a micro-batch
        with its targets, such as a loss weighed by their units. Returns the batch's mean
        loss on the last stage, 0 elsewhere."""
        self._loss_scale = scale / self.microbatches
        self._step_loss = loss_fn or self._loss_fn
        self._losses = []
        args, kwargs = self._call_args(inputs)
        self.schedule.step(*args, target=target if self.last else None, **kwargs)
        if not self.last:
            return torch.zeros((), device=target.device)
        # The first step of manual stages also runs the loss once on shape-inference data.
        return torch.stack(self._losses[-self.microbatches:]).mean()

    @torch.no_grad()
    def forward(self, inputs: Any, target: torch.Tensor) -> Any:
        """Outputs of a whole batch (on the last stage; None elsewhere), no gradients."""
        args, kwargs = self._call_args(inputs)
        self._losses, self._step_loss = [], self._loss_fn
        outputs = self.schedule.eval(*args, target=target if self.last else None, **kwargs)
        return self._outputs(outputs) if self.last else None

    def _call_args(self, inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The first stage's arguments, shaped per sample as the model was traced; manual
        stages all take the inputs, as keyword arguments."""
        if not (self.first or self.manual):
            return (), {}
        args, kwargs = _as_call(inputs)
        shapes = _sample_shapes(args, kwargs)
        if shapes != self._sample_shapes:
            raise UserError(
                "Pipeline parallelism runs the model as traced, and its stages exchange "
                f"fixed-size activations: inputs were traced shaped {self._sample_shapes} per "
                f"sample, and this batch's are {shapes}. A workload whose batches vary in "
                "length (such as speech, padded to each batch's longest clip) cannot be "
                "pipelined; use --strategy fsdp or ddp.")
        return ((), manual.as_keywords(inputs)) if self.manual else (args, kwargs)

    def broadcast_from_last(self, value: Any) -> Any:
        """Hand an object computed on the last stage to every stage of this pipeline."""
        box = [value]
        dist.broadcast_object_list(box, group=self.group, group_src=self._last_rank)
        return box[0]

    def sync_tied_grads(self) -> None:
        """Sum the gradients of parameter copies that live in several stages. A copy that
        got none here while another did (a manual stage's unused embedding) takes the sum
        too, so that every copy takes the same step."""
        if not self._tied:
            return
        groups = [[module.get_parameter(fqn) for module, fqn in copies]
                  for _, copies in self._tied]
        device = self.stages[0].device
        used = torch.tensor([float(any(p.grad is not None for p in group)) for group in groups],
                            device=device)
        dist.all_reduce(used, group=self.group)
        for (canonical, _), group, anywhere in zip(self._tied, groups, used.tolist(),
                                                   strict=True):
            if not anywhere:
                continue
            grads = [_local(p.grad) for p in group if p.grad is not None]
            total = (torch.stack(grads).sum(0) if grads
                     else torch.zeros(self._grad_shape(canonical), device=device))
            dist.all_reduce(total, group=self.group)
            for param in group:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                _local(param.grad).copy_(total)

    def _grad_shape(self, name: str) -> torch.Size:
        shape = self._tied_shapes[name]
        if self.grad_shards is None:
            return shape
        size, rank = self.grad_shards
        chunks = torch.empty(shape, device="meta").chunk(size)
        return chunks[rank].shape if rank < len(chunks) else torch.Size([0, *shape[1:]])

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over the whole model: every stage, each tied copy counted once."""
        unique = [p for name, p in self.parts.named_parameters()
                  if p.grad is not None and self._counted_in_norm(name)]
        norm = torch.nn.utils.get_total_norm([p.grad for p in unique])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=self.group)
        total = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(list(self.parts.parameters()), max_norm, total)
        return total

    def _counted_in_norm(self, local: str) -> bool:
        """Whether this copy counts in the global norm: each tied copy counts once, and the
        parameters every manual stage holds count on the first stage only."""
        if not self.manual:
            return self.names.is_canonical_copy(local)
        part = int(local[len(PART_PREFIX):].split(".", 1)[0])
        name = self.names.original(local)
        return (self.stages[part].stage_index == 0
                or name.startswith(tuple(block + "." for block in self.block_names)))

    # --- state: under the original parameter names (``gpuflow.parallel.pipeline_state``) ---

    def state_to_save(self, optimizer: torch.optim.Optimizer
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return state_to_save(self.parts, self.names, optimizer)

    def state_to_load(self, optimizer: torch.optim.Optimizer, model_keys: Collection[str]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return state_to_load(self.parts, self.names, optimizer, model_keys)

    def load(self, model_state: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
             optimizer_state: dict[str, Any], full: bool) -> None:
        load_state(self.parts, self.names, model_state, optimizer, optimizer_state, full)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name -> the name ``named_parameters()`` reports for that tensor."""
    first: dict[int, str] = {}
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(param), name)
    return names


def _block_names(model: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    if not blocks:
        raise UserError(
            "Pipeline parallelism splits the workload's repeated blocks, and it has none: "
            "give the model an nn.ModuleList attribute `blocks`, or set "
            "Workload(repeated_blocks=...)."
        )
    names = {id(module): name for name, module in model.named_modules()}
    try:
        return [names[id(block)] for block in blocks]
    except KeyError:
        raise UserError("The workload's repeated blocks are not submodules of its model.") from None


def _split_points(block_names: list[str], stages: int) -> dict[str, SplitPoint]:
    """Cut before evenly spaced blocks so each stage holds a near-equal share."""
    if len(block_names) < stages:
        raise UserError(
            f"{stages} pipeline stages need at least {stages} repeated blocks; the model has "
            f"{len(block_names)}. Lower --pp, or use --pp-schedule 1f1b (one stage per rank)."
        )
    return {block_names[start]: SplitPoint.BEGINNING
            for start, _ in manual.stage_bounds(len(block_names), stages)[1:]}


def _check_input_order(graph: torch.fx.Graph) -> None:
    """The schedule hands the first stage the model's inputs in the model's order, and the
    splitter may order that stage's parameters otherwise (by first use: a speech model's
    lengths before its waves), which would feed each input to the other's place."""
    inputs = [node.name for node in graph.nodes if node.op == "placeholder"]
    first = next(node for node in graph.nodes if node.op == "call_module")
    taken = [arg.name for arg in first.args if isinstance(arg, torch.fx.Node)]
    if taken != inputs and sorted(taken) == sorted(inputs):
        raise ValueError(f"the first stage takes the inputs as ({', '.join(taken)}), "
                         f"the model as ({', '.join(inputs)})")


def _stage_index(submod_name: str) -> int:
    """Stage submodules are named ``submod_pp_<index>`` (``submod_<index>`` in older releases)."""
    return int(submod_name.rsplit("_", 1)[1])
