"""The traced split may hand its first stage the model's inputs in another order than the
model's (a speech model's lengths before its waves, by first use); the schedule passes
them in the model's order, so such a split is refused (and ``auto`` cuts by hand)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from gpuflow.models.asr import ConformerCTC
from gpuflow.parallel.pipeline import _check_input_order
from gpuflow.workloads.asr import SAMPLE_RATE, collate_utterances
from gpuflow.workloads.asr_synthetic import SyntheticUtterances

# torch's tracer warns about its own deprecated pytree calls.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")


def test_a_first_stage_taking_the_inputs_reordered_is_refused() -> None:
    torch.manual_seed(0)
    data = SyntheticUtterances(4, 7, SAMPLE_RATE)
    model = ConformerCTC(len(data.vocabulary), dim=16, depth=2, heads=2, spec_augment=False)
    (waves, lengths), _ = collate_utterances([data[0]])
    pipe = pipeline(model, mb_args=(waves, lengths),
                    split_spec={"blocks.1": SplitPoint.BEGINNING})
    with pytest.raises(ValueError, match=r"takes the inputs as \(lengths, waves\), the model "
                                         r"as \(waves, lengths\)"):
        _check_input_order(pipe.split_gm.graph)


class _InOrder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        x = x - shift  # not symmetric: swapped inputs would give another output
        for block in self.blocks:
            x = block(x)
        return x


def test_a_first_stage_taking_the_inputs_in_order_passes() -> None:
    torch.manual_seed(0)
    model, inputs = _InOrder(), (torch.randn(2, 4), torch.randn(2, 1))
    pipe = pipeline(model, mb_args=inputs, split_spec={"blocks.1": SplitPoint.BEGINNING})
    graph = pipe.split_gm.graph
    first = next(node for node in graph.nodes if node.op == "call_module")
    assert [arg.name for arg in first.args if isinstance(arg, torch.fx.Node)] == ["x", "shift"]
    assert _check_input_order(graph) is None
    torch.testing.assert_close(pipe(*inputs), (model(*inputs),))  # the Pipe returns a tuple
