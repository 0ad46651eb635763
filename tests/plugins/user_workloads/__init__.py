"""Workloads as a user would write them, imported by tests through `pkg.module:factory`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import gpuflow
from gpuflow.workloads import digits, speech


class TinyMLP(nn.Module):
    def __init__(self, features: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(features, features), nn.GELU())
                                    for _ in range(2))
        self.head = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _separable(n: int, features: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    centers = torch.randn(classes, features, generator=torch.Generator().manual_seed(99)) * 3
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=generator)
    return TensorDataset(centers[labels] + torch.randn(n, features, generator=generator), labels)


def mlp() -> gpuflow.Workload:
    return gpuflow.Workload(name="user-mlp", model=TinyMLP(), train_dataset=_separable(512),
                            val_dataset=_separable(128, seed=1))


def not_a_workload() -> dict:
    return {"model": TinyMLP()}


def wrong_shape() -> gpuflow.Workload:
    data = TensorDataset(torch.randn(64, 7), torch.randint(0, 4, (64,)))
    return gpuflow.Workload(name="wrong-shape", model=TinyMLP(), train_dataset=data)


def single_items() -> gpuflow.Workload:
    return gpuflow.Workload(name="single", model=TinyMLP(), train_dataset=torch.randn(64, 16))


class Diverging(nn.Module):
    """Returns NaN logits from step ``after`` on, as a blown-up model would."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.net = TinyMLP()
        self.after = after
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                return out * float("nan")
        return out


def diverging() -> gpuflow.Workload:
    after = int(os.environ.get("DIVERGE_AFTER", "5"))
    return gpuflow.Workload(name="diverging", model=Diverging(after),
                            train_dataset=_separable(512), val_dataset=_separable(64, seed=1))


class GatedDataset(Dataset):
    """Blocks every fetch once the checkpoint named by $GATE_CHECKPOINT exists.

    The training process then hangs at a known point, after that checkpoint was written,
    so a test can kill it there with SIGKILL.
    """

    def __init__(self, base: Dataset) -> None:
        self.base = base
        gate = os.environ.get("GATE_CHECKPOINT")
        self.gate = Path(gate) if gate else None

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        while self.gate is not None and self.gate.exists():
            time.sleep(0.05)
        return self.base[index]


def gated_digits() -> gpuflow.Workload:
    workload = digits.build(width=16, depth=2)
    workload.example_batch = workload.collate([workload.train_dataset[i] for i in range(8)])
    workload.train_dataset = GatedDataset(workload.train_dataset)
    return workload


def gated_speech(data_dir: str) -> gpuflow.Workload:
    """The tiny speech model on ``data_dir``, augmented, with the gate of ``GatedDataset``."""
    workload = speech.build(data_dir=data_dir, model_size="tiny")
    workload.train_dataset = GatedDataset(workload.train_dataset)
    return workload


class KillOnceDataset(Dataset):
    """SIGKILLs rank $KILL_RANK on the first attempt once $KILL_AFTER_CHECKPOINT exists,
    as a crashed node would; a restarted attempt runs normally."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        marker = os.environ.get("KILL_AFTER_CHECKPOINT")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (marker and first_attempt and os.environ.get("RANK") == os.environ.get("KILL_RANK")
                and Path(marker).exists()):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.base[index]


def killed_mlp() -> gpuflow.Workload:
    workload = mlp()
    workload.example_batch = workload.collate([workload.train_dataset[i] for i in range(8)])
    workload.train_dataset = KillOnceDataset(workload.train_dataset)
    return workload


def tiny_gpt() -> gpuflow.Workload:
    """A small 4-block GPT on random bytes, with the Megatron tensor-parallel plan; the
    default loss reads its sequence logits per position."""
    from gpuflow.models.gpt import GPT, GPTConfig
    from gpuflow.parallel.tensor import transformer_plan

    generator = torch.Generator().manual_seed(0)
    seq = 32
    text = torch.randint(0, 64, (4096 + 1,), generator=generator)
    starts = torch.arange(0, 4096 - seq, seq)
    inputs = torch.stack([text[s:s + seq] for s in starts])
    targets = torch.stack([text[s + 1:s + seq + 1] for s in starts])
    return gpuflow.Workload(
        name="tiny-gpt",
        model=GPT(GPTConfig(vocab_size=64, seq_len=seq, layers=4, dim=32, heads=4)),
        train_dataset=TensorDataset(inputs, targets),
        val_dataset=TensorDataset(inputs[:20], targets[:20]),
        metrics={},
        tokens_per_sample=seq,
        tensor_parallel_plan=transformer_plan(),
    )


def tiny_gpt_sequence_parallel() -> gpuflow.Workload:
    """``tiny_gpt`` whose plan also splits norms and the residual stream along the sequence."""
    from gpuflow.parallel.tensor import transformer_plan

    workload = tiny_gpt()
    workload.tensor_parallel_plan = transformer_plan(sequence_parallel=True)
    return workload


class CheckedGPT(nn.Module):
    """A GPT that validates its token ids first: data-dependent Python control flow, which
    torch.export cannot trace, so pipelining cuts it into stages by hand."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if bool((tokens >= self.gpt.config.vocab_size).any()):
            raise ValueError("token id out of range")
        return self.gpt(tokens)


def checked_gpt() -> gpuflow.Workload:
    workload = tiny_gpt()
    workload.model = CheckedGPT(workload.model)
    workload.repeated_blocks = lambda model: model.gpt.blocks
    workload.tensor_parallel_plan = None
    return workload


class MaskedClassifier(nn.Module):
    """Takes two tensors by name: features and a 0/1 mask of the features to use."""

    def __init__(self, features: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.body = TinyMLP(features, classes)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.body(features * mask)


class NamedInputs(Dataset):
    """``({"features": x, "mask": m}, label)`` items, as a feature pipeline yields them."""

    def __init__(self, base: TensorDataset, seed: int) -> None:
        self.base = base
        features = base.tensors[0].shape[1]
        generator = torch.Generator().manual_seed(seed)
        self.masks = (torch.rand(len(base), features, generator=generator) > 0.1).long()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        x, y = self.base[index]
        return {"features": x, "mask": self.masks[index]}, y


def masked() -> gpuflow.Workload:
    return gpuflow.Workload(name="user-masked", model=MaskedClassifier(),
                            train_dataset=NamedInputs(_separable(512), seed=3),
                            val_dataset=NamedInputs(_separable(128, seed=1), seed=4))


def unbuildable() -> gpuflow.Workload:
    """A factory that fails as a broken environment would, for the server's start-up."""
    raise gpuflow.UserError("the model's configuration file is missing")
