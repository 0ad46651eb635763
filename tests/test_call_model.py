"""One rule calls a model with a batch's inputs, in training and in serving alike: a mapping
(a dict, or a ``UserDict`` such as transformers' ``BatchEncoding``) as keyword arguments, a
tuple or list as positional ones, anything else as the one argument."""

from __future__ import annotations

from collections import UserDict
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from gpuflow.config import TrainConfig
from gpuflow.serve.model import Runner
from gpuflow.train.trainer import train
from gpuflow.workload import Workload, call_model


class Encoding(UserDict):
    """Shaped like transformers' BatchEncoding: a mapping that is not a dict."""


class KeywordsOnly(nn.Module):
    """Accepts its inputs by name only, so a mapping passed positionally fails loudly."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.calls: list[str] = []

    def forward(self, *, features: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self.calls.append("keywords")
        return self.linear(features) * scale


def encoded(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Encoding, torch.Tensor]:
    features = torch.stack([features for features, _ in samples])
    target = torch.stack([target for _, target in samples])
    return Encoding(features=features, scale=torch.ones(len(samples), 1)), target


def test_the_rule_for_each_kind_of_inputs() -> None:
    def positional(*args: torch.Tensor, **kwargs: torch.Tensor) -> tuple:
        return args, kwargs

    x = torch.ones(1)
    assert call_model(positional, Encoding(a=x)) == ((), {"a": x})
    assert call_model(positional, {"a": x}) == ((), {"a": x})
    assert call_model(positional, (x, x)) == ((x, x), {})
    assert call_model(positional, [x]) == ((x,), {})
    assert call_model(positional, x) == ((x,), {})


def test_training_calls_a_user_dict_as_keywords(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    model = KeywordsOnly()
    before = model.linear.weight.detach().clone()
    workload = Workload("keywords", model, data, collate_fn=encoded)
    result = train(workload, TrainConfig(batch_size=4, max_steps=2, run_dir=str(tmp_path),
                                         save_checkpoints=False, progress=False, eval_every=0))
    assert result.steps == 2
    assert model.calls.count("keywords") >= 2  # the training steps, at least
    assert not torch.equal(model.linear.weight.detach(), before)  # backward reached it


def test_serving_calls_a_user_dict_as_keywords() -> None:
    torch.manual_seed(0)
    model = KeywordsOnly()
    features = torch.randn(2, 4)
    outputs = Runner(model, device="cpu").call(Encoding(features=features,
                                                        scale=torch.ones(2, 1)))
    assert model.calls == ["keywords"]
    torch.testing.assert_close(outputs, model.linear(features), rtol=0, atol=0)


def test_the_loader_and_the_pipeline_read_a_user_dict_as_a_mapping() -> None:
    """The device copy keeps every tensor of a mapping batch (on a GPU the tensors of a
    ``BatchEncoding`` must move), and pipelined stages take its entries as keywords."""
    from gpuflow.data.prefetch import move_to_device
    from gpuflow.parallel.pipeline import _as_call

    x = torch.arange(3)
    moved = move_to_device(Encoding(ids=x, mask=x > 0), torch.device("meta"))
    assert {key: value.device.type for key, value in moved.items()} == {"ids": "meta",
                                                                        "mask": "meta"}
    assert _as_call(Encoding(ids=x)) == ((), {"ids": x})
