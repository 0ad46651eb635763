"""A CTC speech recogniser on raw waveforms: log-mel, SpecAugment, convolutional
subsampling (4x fewer frames), a conformer encoder and a linear map to characters.

The front end is the isolated-digit classifier's (``gpuflow.models.speech``): per-clip
normalised log-mel frames computed on the device, and a 2-D convolutional subsampler whose
filters over frequency tolerate the formant shifts between voices. The encoder is a
conformer (Gulati et al. 2020): self-attention gives each frame the utterance's context, and
a depthwise convolution the local shape of a phone, which is what a character boundary needs.
Every stage masks padded frames, so an utterance's logits do not depend on its batch-mates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuflow.models.speech import ConvSubsample, LogMel, frame_counts, frame_mask, sinusoids


def spec_augment(feats: torch.Tensor, counts: torch.Tensor, freq_masks: int = 2,
                 freq_width: int = 8, time_masks: int = 2, time_share: float = 0.05
                 ) -> torch.Tensor:
    """``feats`` ``(B, frames, mels)`` with bands and stretches of time zeroed (SpecAugment,
    Park et al. 2019): each time mask spans at most ``time_share`` of the clip's own frames."""
    batch, frames, bands = feats.shape
    device = feats.device
    keep = torch.ones(batch, frames, bands, dtype=torch.bool, device=device)
    band = torch.arange(bands, device=device)[None, :]
    for _ in range(freq_masks):
        width = torch.randint(0, freq_width + 1, (batch, 1), device=device)
        start = (torch.rand(batch, 1, device=device) * (bands - width + 1)).long()
        keep &= ~((band >= start) & (band < start + width))[:, None, :]
    frame = torch.arange(frames, device=device)[None, :]
    for _ in range(time_masks):
        width = (torch.rand(batch, 1, device=device) * time_share * counts[:, None]).long()
        start = (torch.rand(batch, 1, device=device) * (counts[:, None] - width + 1)).long()
        keep &= ~((frame >= start) & (frame < start + width))[:, :, None]
    return feats * keep


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.SiLU(),
                         nn.Dropout(dropout), nn.Linear(4 * dim, dim), nn.Dropout(dropout))


class ConvModule(nn.Module):
    """Pointwise conv and GLU, a depthwise conv over time with batch norm, pointwise conv;
    padded frames are zeroed before the depthwise conv reads them."""

    def __init__(self, dim: int, kernel: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.expand = nn.Conv1d(dim, 2 * dim, 1)
        self.depthwise = nn.Conv1d(dim, dim, kernel, padding=kernel // 2, groups=dim)
        self.batch_norm = nn.BatchNorm1d(dim)
        self.project = nn.Conv1d(dim, dim, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = F.glu(pointwise(self.expand, self.norm(x)), dim=-1)
        y = y * mask[..., None].to(y.dtype)
        y = F.silu(self.batch_norm(depthwise(self.depthwise, y.transpose(1, 2))))
        return self.dropout(pointwise(self.project, y.transpose(1, 2)))


def pointwise(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """A kernel-1 ``conv`` over ``x`` ``(B, frames, channels)`` as the matrix product it is."""
    return F.linear(x, conv.weight.squeeze(-1), conv.bias)


@torch.compiler.disable
def depthwise(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)``, run eagerly inside a compiled block: inductor's convolution backward
    fixes its input's strides, so each new frame count would compile the block again (one
    graph per batch length until dynamo's recompile limit, then eager with no word said)."""
    return conv(x)


class ConformerBlock(nn.Module):
    """Half-step feed-forward, self-attention over unpadded frames, convolution, half-step
    feed-forward, layer norm."""

    def __init__(self, dim: int, heads: int, kernel: int = 15, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ff1 = FeedForward(dim, dropout)
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.conv = ConvModule(dim, kernel, dropout)
        self.ff2 = FeedForward(dim, dropout)
        self.norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.ff1(x)
        batch, frames, dim = x.shape
        q, k, v = (self.qkv(self.attn_norm(x))
                   .view(batch, frames, 3, self.heads, dim // self.heads)
                   .permute(2, 0, 3, 1, 4))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(batch, frames, dim)))
        x = x + self.conv(x, mask)
        return self.norm(x + 0.5 * self.ff2(x))


class ConformerCTC(nn.Module):
    """``forward(waves, lengths) -> {"logits": (B, frames, vocab), "frames": (B,)}``; logit
    0 is CTC's blank."""

    def __init__(self, vocab_size: int, sample_rate: int = 16000, n_mels: int = 40,
                 dim: int = 144, depth: int = 4, heads: int = 4, kernel: int = 15,
                 dropout: float = 0.1, spec_augment: bool = True) -> None:
        super().__init__()
        hop = sample_rate // 100  # 10 ms frames over a 25 ms window
        self.features = LogMel(sample_rate=sample_rate, n_fft=sample_rate // 40, hop=hop,
                               n_mels=n_mels)
        self.subsample = ConvSubsample(n_mels, dim, dropout=dropout)
        self.blocks = nn.ModuleList(ConformerBlock(dim, heads, kernel, dropout)
                                    for _ in range(depth))
        self.head = nn.Linear(dim, vocab_size)
        self.augment = spec_augment

    def output_frames(self, lengths: torch.Tensor) -> torch.Tensor:
        """Logit frames for clips of ``lengths`` samples: 10 ms frames, halved twice."""
        counts = frame_counts(lengths, self.features.hop)
        return ((counts + 1) // 2 + 1) // 2

    def forward(self, waves: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        feats, mask = self.features(waves, lengths)
        counts = mask.sum(dim=1)
        if self.training and self.augment:
            feats = spec_augment(feats, counts)
        x, frames = self.subsample(feats, counts)
        x = x + sinusoids(x.shape[1], x.shape[2], x.device)
        mask = frame_mask(frames, x.shape[1])
        for block in self.blocks:
            x = block(x, mask)
        return {"logits": self.head(x), "frames": frames}
