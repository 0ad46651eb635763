"""ParallelDims: one value for a run's layout, which only exists if gpuflow can run it."""

from __future__ import annotations

import pytest

from gpuflow.config import build_config
from gpuflow.errors import UserError
from gpuflow.parallel.dims import ParallelDims


def test_flags_resolve_to_degrees_and_defaults() -> None:
    assert ParallelDims.resolve(1) == ParallelDims(strategy="single")
    assert ParallelDims.resolve(4) == ParallelDims(strategy="ddp", dp=4)
    assert ParallelDims.resolve(4, "tp") == ParallelDims(strategy="tp", tp=4)
    assert ParallelDims.resolve(8, "fsdp", pp=2) == ParallelDims(strategy="fsdp", dp=4, pp=2)
    dims = ParallelDims.from_config(build_config({}, {"strategy": "fsdp", "tp": 2,
                                                     "fsdp_wrap": "model"}), 8)
    assert (dims.dp, dims.tp, dims.fsdp_wrap) == (4, 2, "model")


@pytest.mark.parametrize(("fields", "message"), [
    ({"strategy": "ddp", "pp": 2}, "model parallelism composes with fsdp"),
    ({"strategy": "tp", "dp": 2, "tp": 2}, "leaves 2 data-parallel replicas"),
    ({"strategy": "fsdp", "dp": 2, "tp": 2, "pp": 2}, "tensor parallelism inside pipeline"),
    ({"strategy": "single", "dp": 2}, "--strategy single runs one process"),
    ({"strategy": "zero3"}, "--strategy must be one of"),
    ({"strategy": "fsdp", "dp": 0}, "every degree must be at least 1"),
])
def test_a_layout_gpuflow_cannot_run_cannot_be_made(fields: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        ParallelDims(**fields)


def test_runnable_layouts_are_exactly_those_the_trainer_takes() -> None:
    names = {mesh: [d.describe() for d in ParallelDims.runnable(*mesh)]
             for mesh in [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1), (2, 2, 1), (2, 1, 2),
                          (1, 2, 2)]}
    assert names == {
        (1, 1, 1): ["single dp1xtp1xpp1"],
        (1, 2, 1): ["tp dp1xtp2xpp1"],
        (1, 1, 2): ["pp dp1xtp1xpp2"],
        (2, 1, 1): ["fsdp dp2xtp1xpp1", "fsdp(no-reshard) dp2xtp1xpp1",
                    "fsdp(model) dp2xtp1xpp1", "ddp dp2xtp1xpp1"],
        (2, 2, 1): ["fsdp dp2xtp2xpp1", "fsdp(no-reshard) dp2xtp2xpp1",
                    "fsdp(model) dp2xtp2xpp1"],
        (2, 1, 2): ["fsdp dp2xtp1xpp2", "fsdp(no-reshard) dp2xtp1xpp2",
                    "fsdp(model) dp2xtp1xpp2"],
        (1, 2, 2): [],
    }
    prefetched = [d.fsdp_wrap for d in ParallelDims.runnable(2, 1, 1, fsdp_prefetch=2)]
    assert "model" not in prefetched


def test_global_batch_mesh_and_pipeline_microbatches() -> None:
    dims = ParallelDims(strategy="fsdp", dp=2, pp=2, pp_schedule="interleaved-1f1b")
    assert dims.global_batch(8, 3) == 48
    assert dims.mesh_shape() == ((2, 2), ("pp", "dp"))
    assert ParallelDims(strategy="fsdp", dp=2, tp=2).mesh_shape() == ((2, 2), ("dp", "tp"))
    assert ParallelDims(strategy="ddp", dp=2).mesh_shape() is None
    assert dims.stages == 4
    assert dims.pipeline_microbatches(8) == 4  # twice the ranks of the pipeline
    with pytest.raises(UserError, match="does not split into --microbatches 4"):
        dims.pipeline_microbatches(6)
    with pytest.raises(UserError, match="at least as many micro-batches as pipeline stages"):
        ParallelDims(strategy="pp", pp=2, pp_schedule="interleaved-1f1b",
                     microbatches=2).pipeline_microbatches(8)
    assert ParallelDims(strategy="single").pipeline_microbatches(8) == 1


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"strategy": "ddp", "tp": 2}, "model parallelism composes with fsdp"),
        ({"strategy": "tp", "tp": 3}, "--tp 3 x --pp 1 does not divide"),
        ({"strategy": "fsdp", "tp": 2, "pp": 2}, "tensor parallelism inside pipeline stages"),
        ({"strategy": "pp", "pp": 1, "dp": 2}, "--dp 2 x --tp 1 x --pp 2 must equal"),
        ({"strategy": "single"}, "--strategy single runs one process"),
    ],
)
def test_bad_meshes_are_explained(values: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        ParallelDims.from_config(build_config({}, values), 2)
