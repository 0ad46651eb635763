import contextlib

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpuflow.telemetry.flops import count_flops, count_training_flops
from gpuflow.workload import call_model, resolve_workload


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

    # By the convention the backward is twice the forward: 4 such matmuls (torch's own
    # formula adds a fifth, the QK^T that fused kernels recompute).
    assert count_flops(forward_backward) == (2 + 4) * (2 * b * h * t * t * d)


def test_a_gpt_step_counts_the_fields_analytic_flops() -> None:
    """6 x the matmul parameters per token, plus 12 x layers x dim x context for attention
    (PaLM's appendix B; causal attention counted in full), and nothing else that is
    large: within 1%. Measured here: the count is the formula exactly."""
    from gpuflow.workloads import textlm

    layers, dim, seq, batch = 2, 64, 128, 3
    workload = textlm.build(data="synthetic",
                            model_size=f"layers={layers},dim={dim},heads=4,seq={seq}")
    inputs, target = workload.get_example_batch()
    inputs, target = inputs[:batch], target[:batch]
    counted = count_training_flops(workload.model, inputs, target, workload.loss_fn,
                                   contextlib.nullcontext())
    matmul_params = layers * 12 * dim * dim + dim * 256  # blocks, and the tied head
    per_token = 6 * matmul_params + 12 * layers * dim * seq
    assert counted == pytest.approx(per_token * batch * seq, rel=0.01)


@pytest.mark.parametrize(("name", "size"), [("digits", None), ("mnist-idx", None),
                                            ("textlm", "tiny"), ("speech", "tiny")])
def test_fake_tensor_count_equals_a_real_step_and_touches_nothing(name: str,
                                                                  size: str | None) -> None:
    workload = resolve_workload(name, {"data": "synthetic",
                                       **({"model_size": size} if size else {})})
    model, (inputs, target) = workload.model, workload.get_example_batch()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    fake = count_training_flops(model, inputs, target, workload.loss_fn,
                                contextlib.nullcontext())
    assert all(param.grad is None for param in model.parameters())
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())

    def real_step() -> None:
        workload.loss_fn(call_model(model, inputs), target).backward()

    assert fake == count_flops(real_step) > 0
