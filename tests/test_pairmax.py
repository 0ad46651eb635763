"""``pair_max`` is ``F.max_pool2d(x, (2, 1))`` exactly: values, NaN, and the gradient,
which max-pool gives whole to the first of two equal values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuflow.models.pairmax import pair_max


def pooled_and_grad(x: torch.Tensor, grad: torch.Tensor, pool: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out = F.max_pool2d(x, (2, 1)) if pool else pair_max(x, 2)
    (x_grad,) = torch.autograd.grad(out, x, grad)
    return out.detach(), x_grad


@pytest.mark.parametrize("case", ["random", "ties", "nan"])
def test_pair_max_is_max_pool_over_the_mel_axis(case: str) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 10, 7, generator=generator)
    if case == "ties":
        x[:, :, 1::2] = x[:, :, 0::2]  # every pair equal: max-pool's gradient goes first
        x[0, 0, 3] = x[0, 0, 2] + 1.0  # and one pair whose second is larger
    if case == "nan":
        x[0, 1, 4, 2] = float("nan")  # the first of a pair
        x[1, 2, 7, 5] = float("nan")  # the second of a pair
    grad = torch.randn(3, 4, 5, 7, generator=generator)
    expected, expected_grad = pooled_and_grad(x, grad, pool=True)
    got, got_grad = pooled_and_grad(x, grad, pool=False)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert torch.equal(got_grad, expected_grad)


def test_pair_max_refuses_an_odd_axis() -> None:
    with pytest.raises(ValueError, match="even size"):
        pair_max(torch.zeros(1, 1, 5, 2), 2)
