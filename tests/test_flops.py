import torch
from torch import nn
from torch.nn import functional as F

from gpuflow.train.flops import count_flops


def test_linear_layer_flops_match_a_hand_count() -> None:
    batch, fan_in, fan_out = 32, 64, 16
    layer = nn.Linear(fan_in, fan_out)
    x = torch.randn(batch, fan_in, requires_grad=True)

    def step() -> None:
        layer(x).sum().backward()

    # forward 2*B*I*O; backward: grad input 2*B*O*I and grad weight 2*O*B*I.
    assert count_flops(step) == 6 * batch * fan_in * fan_out


def test_linear_without_input_grad_counts_forward_and_weight_grad() -> None:
    layer = nn.Linear(10, 3)
    x = torch.randn(5, 10)

    def step() -> None:
        layer(x).sum().backward()

    assert count_flops(step) == 4 * 5 * 10 * 3


def test_cpu_attention_is_counted() -> None:
    b, h, t, d = 2, 4, 32, 16
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))

    def forward_only() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)

    # QK^T and AV: 2 matmuls of 2*b*h*t*t*d FLOPs each.
    assert count_flops(forward_only) == 2 * (2 * b * h * t * t * d)

    def forward_backward() -> None:
        F.scaled_dot_product_attention(q, k, v).sum().backward()

    # torch's flash-attention backward formula: 5 such matmuls (QK^T is recomputed).
    assert count_flops(forward_backward) == (2 + 5) * (2 * b * h * t * t * d)
