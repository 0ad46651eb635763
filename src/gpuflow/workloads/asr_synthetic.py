"""Random utterances for throughput runs of the asr workload (``--data synthetic``): noise
of 1-8 s with transcripts of 2-7 random digit words, each a function of its index only.

Their vocabulary is the digit words' characters, the one a connected-digit run builds, so a
server can rebuild such a run's network without its data.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from gpuflow.workloads.asr_text import Vocabulary

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SECONDS = (1.0, 8.0)
COUNTS = (4000, 200)  # train, validation


class SyntheticUtterances(Dataset):
    """Items as ``asr.Utterances`` gives them, at ``sample_rate``."""

    def __init__(self, count: int, seed: int, sample_rate: int) -> None:
        self.count, self.seed, self.sample_rate = count, seed, sample_rate
        self.vocabulary = Vocabulary.from_texts([" ".join(DIGIT_WORDS)])

    def __len__(self) -> int:
        return self.count

    def _draw(self, index: int) -> tuple[torch.Generator, float, str]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        low, high = SECONDS
        seconds = low + (high - low) * float(torch.rand(1, generator=generator))
        words = int(torch.randint(2, 8, (1,), generator=generator))
        digits = torch.randint(0, 10, (words,), generator=generator).tolist()
        return generator, seconds, " ".join(DIGIT_WORDS[d] for d in digits)

    def __getitem__(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        generator, seconds, text = self._draw(index)
        length = int(seconds * self.sample_rate)
        wave = 0.1 * torch.randn(length, generator=generator)
        ids = torch.tensor(self.vocabulary.encode(text), dtype=torch.int64)
        return (wave, torch.tensor(length, dtype=torch.int64)), ids

    def durations(self) -> list[float]:
        return [self._draw(i)[1] for i in range(self.count)]
