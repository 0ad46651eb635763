"""The strategies in one process: each layout gets its family, what a strategy cannot do is
refused, and FSDP gathers as many blocks ahead as --fsdp-prefetch says."""

from __future__ import annotations

import pytest
import torch

from gpuflow.errors import UserError
from gpuflow.parallel import build_strategy
from gpuflow.parallel.dims import ParallelDims
from gpuflow.parallel.replicated import Replicated
from gpuflow.parallel.sharded import Sharded
from gpuflow.parallel.single import Single
from gpuflow.precision import make_policy
from gpuflow.telemetry.steps import StepTimer


@pytest.mark.parametrize(("dims", "family"), [
    (ParallelDims(strategy="single"), Single),
    (ParallelDims(strategy="ddp", dp=2), Replicated),
    (ParallelDims(strategy="fsdp", dp=2), Sharded),
])
def test_each_layout_gets_its_family(dims: ParallelDims, family: type) -> None:
    cpu = torch.device("cpu")
    strategy = build_strategy(dims, cpu, make_policy("fp32", cpu), StepTimer(cpu))
    assert type(strategy) is family


def test_loss_scaling_is_refused_where_the_strategy_cannot_scale() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(UserError, match="--strategy fsdp supports fp32, tf32 and bf16"):
        build_strategy(ParallelDims(strategy="fsdp", dp=2), cpu, make_policy("fp16", cpu),
                       StepTimer(cpu))


def _gathered_early(prefetch: int | None) -> tuple[set[str], set[str]]:
    """The blocks whose all-gather FSDP has started when the first block's forward ends, and
    when the last block's gradients are reduced, in a 1-rank gloo job of 5 blocks."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from gpuflow.parallel.sharded import apply_fsdp

    events: list[tuple[str, str]] = []
    unshard, post_backward = FSDPParamGroup.unshard, FSDPParamGroup.post_backward
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        blocks = list(model[:5])
        apply_fsdp(model, blocks, None, reshard_after_forward=True, prefetch=prefetch)
        names = {id(block): f"b{index}" for index, block in enumerate(blocks)}

        def recorded(kind: str, method):
            def call(group, *args, **kwargs):
                events.append((kind, names.get(id(group.modules[0]), "root")))
                return method(group, *args, **kwargs)
            return call

        blocks[0].register_forward_hook(lambda *_: events.append(("forward", "b0")))
        FSDPParamGroup.unshard = recorded("gather", unshard)
        FSDPParamGroup.post_backward = recorded("reduce", post_backward)
        model(torch.randn(4, 8)).sum().backward()
    finally:
        FSDPParamGroup.unshard, FSDPParamGroup.post_backward = unshard, post_backward
        dist.destroy_process_group()
    forward_end = events.index(("forward", "b0"))
    backward_start = events.index(("gather", "root"), forward_end)
    first_reduce = events.index(("reduce", "b4"))

    def gathered(span: list[tuple[str, str]]) -> set[str]:
        return {name for kind, name in span if kind == "gather"} - {"root"}

    return gathered(events[:forward_end]), gathered(events[backward_start:first_reduce])


def test_fsdp_prefetch_gathers_that_many_blocks_ahead_in_forward_and_backward() -> None:
    """FSDP on its own starts one block's all-gather at a time in forward (its implicit
    prefetch needs a device stream) and the next one in backward; --fsdp-prefetch 2 starts
    the two after the running block in forward and the two before it in backward."""
    assert _gathered_early(None) == ({"b0"}, {"b4", "b3"})
    assert _gathered_early(2) == ({"b0", "b1", "b2"}, {"b4", "b3", "b2"})


def test_fsdp_prefetch_needs_blocks_to_prefetch() -> None:
    from gpuflow.errors import UserError
    from gpuflow.parallel.sharded import apply_fsdp

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    with pytest.raises(UserError, match="--fsdp-prefetch 2 gathers the next blocks early, "
                                        "and --fsdp-wrap model"):
        apply_fsdp(model, [model[0]], None, True, wrap="model", prefetch=2)
