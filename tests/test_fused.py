"""Linear layers fused into one matrix product (``serve/generate/fused.py``): one copy of the
weights, the modules' own weights views of it, and weights already laid out so viewed,
not copied again."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpuflow.serve.generate.fused import PREPACK_BYTES, fuse, prepacked


def linears(bias: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(8, out, bias=bias) for out in (8, 4, 4)]


def test_fused_modules_share_one_weight_and_multiply_as_before() -> None:
    modules = linears(bias=True)
    x = torch.randn(5, 8)
    before = [module(x) for module in modules]
    fused = fuse(modules)
    assert fused is not None
    weight, bias = fused
    assert weight.shape == (16, 8) and bias is not None and bias.shape == (16,)
    torch.testing.assert_close(torch.addmm(bias, x, weight.t()), torch.cat(before, dim=-1))
    for module, was in zip(modules, before, strict=True):  # the modules read the fused copy
        assert module.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        torch.testing.assert_close(module(x), was)


def test_weights_already_laid_out_in_one_storage_are_viewed_not_copied() -> None:
    modules = linears(bias=False)
    first, _ = fuse(modules)  # type: ignore[misc]
    again = fuse(modules)  # as a model the server fused arrives in the engine's process
    assert again is not None and again[1] is None
    assert again[0].data_ptr() == first.data_ptr() and torch.equal(again[0], first)


def test_modules_that_cannot_be_fused_are_left_alone() -> None:
    modules = linears(bias=False)
    modules[1].bias = nn.Parameter(torch.zeros(4))  # a bias on one of them only
    assert fuse(modules) is None
    mixed = linears(bias=False)
    mixed[2] = mixed[2].to(torch.bfloat16)
    assert fuse(mixed) is None
    assert all(m.weight.untyped_storage().data_ptr() != mixed[0].weight.untyped_storage()
               .data_ptr() for m in mixed[1:])


def test_input_major_weights_are_one_row_major_product_and_viewed_again() -> None:
    """fp32 on the CPU: the fused weight's transpose is contiguous (``x @ W`` over a
    row-major ``W``), the modules multiply as before through views of it, and a second
    fusion (the engine's process) views it again."""
    modules = linears(bias=True)
    x = torch.randn(5, 8)
    before = torch.cat([module(x) for module in modules], dim=-1)
    weight, bias = fuse(modules, input_major=True)  # type: ignore[misc]
    assert weight.shape == (16, 8) and weight.t().is_contiguous()
    torch.testing.assert_close(torch.addmm(bias, x, weight.t()), before)
    torch.testing.assert_close(torch.cat([m(x) for m in modules], dim=-1), before)
    again, _ = fuse(modules, input_major=True)  # type: ignore[misc]
    assert again.data_ptr() == weight.data_ptr() and again.stride() == weight.stride()
    [single] = linears(bias=False)[:1]
    alone, _ = fuse([single], input_major=True)  # type: ignore[misc]
    assert alone.t().is_contiguous() and single.weight.data_ptr() == alone.data_ptr()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="x86's oneDNN only")
def test_only_large_fp32_weights_are_prepacked_and_multiply_as_before() -> None:
    weight = torch.randn(512, PREPACK_BYTES // (512 * 4))  # 1 MiB of fp32
    packed = prepacked(weight)
    assert packed is not None
    x = torch.randn(6, weight.shape[1])
    torch.testing.assert_close(
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), x @ weight.t(),
        atol=1e-4, rtol=1e-4)
    assert prepacked(weight[:256]) is None  # under PREPACK_BYTES: from cache, through MKL
    assert prepacked(weight.bfloat16()) is None
