"""A small speech classifier that takes raw waveforms: log-mel front end, 2-D conv, transformer.

The features are computed inside the model, on the model's device, so the data pipeline only
reads and pads samples. Every stage respects the true clip lengths: a clip's logits are the
same whether it is batched alone or padded beside a longer one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpuflow.models.pairmax import pair_max


def hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    return 2595.0 * torch.log10(1.0 + hz / 700.0)


def mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filterbank(n_freqs: int, n_mels: int, sample_rate: int,
                   f_min: float = 0.0, f_max: float | None = None) -> torch.Tensor:
    """Triangular HTK-mel filters as a ``(n_freqs, n_mels)`` matrix (no torchaudio needed)."""
    f_max = sample_rate / 2 if f_max is None else f_max
    freqs = torch.linspace(0.0, sample_rate / 2, n_freqs, dtype=torch.float64)
    mels = torch.linspace(float(hz_to_mel(torch.tensor(f_min))),
                          float(hz_to_mel(torch.tensor(f_max))), n_mels + 2, dtype=torch.float64)
    edges = mel_to_hz(mels)
    lower, center, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = (freqs[:, None] - lower) / (center - lower)
    falling = (upper - freqs[:, None]) / (upper - center)
    return torch.clamp(torch.minimum(rising, falling), min=0.0).to(torch.float32)


def frame_counts(lengths: torch.Tensor, hop: int) -> torch.Tensor:
    """STFT frames that start inside each clip (at least one)."""
    return torch.clamp((lengths + hop - 1) // hop, min=1)


def frame_mask(counts: torch.Tensor, frames: int) -> torch.Tensor:
    """``(B, frames)`` True where a frame belongs to the clip."""
    return torch.arange(frames, device=counts.device)[None, :] < counts[:, None]


class LogMel(nn.Module):
    """Waveforms ``(B, T)`` to normalised log-mel frames ``(B, frames, n_mels)`` and their mask.

    Samples past each clip's length are zeroed and frames are taken without centring after
    zero-padding by one window, so a frame's content depends only on the clip, never on how
    long the batch is or what the padding held. Each clip is
    normalised over its own valid frames (per-mel mean, one overall scale), which removes
    loudness and channel differences between speakers and recordings. It runs in fp32 under
    any autocast: half-precision power spectra lose the quiet bands the log brings back.
    """

    def __init__(self, sample_rate: int = 8000, n_fft: int = 256, hop: int = 80,
                 n_mels: int = 40, eps: float = 1e-6) -> None:
        super().__init__()
        self.n_fft, self.hop, self.eps = n_fft, hop, eps
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.register_buffer("filters", mel_filterbank(n_fft // 2 + 1, n_mels, sample_rate),
                             persistent=False)

    def forward(self, waves: torch.Tensor,
                lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inside = torch.arange(waves.shape[1], device=waves.device) < lengths[:, None]
        waves = F.pad(waves.float() * inside, (0, self.n_fft))
        spec = torch.stft(waves, self.n_fft, self.hop, window=self.window, center=False,
                          return_complex=True)
        power = spec.real.square() + spec.imag.square()
        # The filterbank's matmul is the one op here autocast would run in half precision;
        # it leaves float64 alone. (A `torch.autocast(enabled=False)` region would do too,
        # but torch.export makes it a submodule named like the stages torch's pipeline
        # splitter creates, and pipeline parallelism then fails to trace the model.)
        mel = (power.transpose(1, 2).double() @ self.filters.double()).float()
        logmel = torch.log(mel + self.eps)
        counts = frame_counts(lengths, self.hop)
        mask = frame_mask(counts, logmel.shape[1])
        weights = mask.unsqueeze(-1).to(logmel.dtype)
        denom = counts.to(logmel.dtype)[:, None, None]
        mean = (logmel * weights).sum(dim=1, keepdim=True) / denom
        centred = (logmel - mean) * weights
        var = centred.square().sum(dim=(1, 2), keepdim=True) / (denom * logmel.shape[2])
        return centred / torch.sqrt(var + 1e-5), mask


class SubSpectralNorm(nn.Module):
    """Batch norm with its own statistics for each of ``sub_bands`` frequency sub-bands of a
    ``(B, channels, bands, frames)`` map (sub-spectral normalisation, as in BC-ResNet).

    One set of statistics per channel would let the loud low bands set the scale of every
    band; per sub-band, a band where a microphone records little (george's recordings have
    almost nothing below 250 Hz) is normalised on its own. In training the statistics cover
    every frame of the batch, padding included; evaluation uses the running statistics, so a
    clip's output never depends on what it is batched with. With frequency before time the
    sub-bands are contiguous, so grouping them is a view, not a copy.
    """

    def __init__(self, channels: int, sub_bands: int) -> None:
        super().__init__()
        self.sub_bands = sub_bands
        self.norm = nn.BatchNorm2d(channels * sub_bands)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, bands, frames = x.shape
        grouped = x.reshape(batch, channels * self.sub_bands, bands // self.sub_bands, frames)
        return self.norm(grouped).reshape(x.shape)


class BroadcastResidual(nn.Module):
    """A broadcasted residual block (BC-ResNet) over a ``(B, channels, bands, frames)`` map.

    A depthwise convolution over frequency, sub-spectrally normalised, keeps the 2-D local
    view; its average over frequency then goes through a depthwise convolution over time and a
    pointwise channel mix, and is broadcast back over every band. Temporal context thus costs
    1-D work, and the frequency path stays local, so a shifted formant moves the features
    instead of changing them. Padded frames are zeroed before the temporal convolution.
    """

    def __init__(self, channels: int, sub_bands: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.freq = nn.Conv2d(channels, channels, (3, 1), padding=(1, 0), groups=channels,
                              bias=False)
        self.freq_norm = SubSpectralNorm(channels, sub_bands)
        self.time = nn.Conv1d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.time_norm = nn.BatchNorm1d(channels)
        self.mix = nn.Conv1d(channels, channels, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        local = self.freq_norm(self.freq(x))
        summary = local.mean(dim=2) * mask[:, None, :].to(x.dtype)
        summary = self.dropout(self.mix(F.silu(self.time_norm(self.time(summary)))))
        return F.relu(x + local + summary[:, :, None, :])


class ConvSubsample(nn.Module):
    """Two 3x3 convolutions over (mel, time), each with stride 2 over time (4x fewer frames for
    attention to handle), sub-spectral batch norm and a max-pool of 2 over mel; then
    broadcasted residual blocks at the reduced resolution and a linear map to the model width.

    Voices differ mostly in where their formants sit on the frequency axis (vocal tract
    length) and in the microphone's colouring; local filters over frequency, pooled, let the
    features tolerate such shifts where a 1-D convolution treats every mel band as its own
    channel. Padded frames are zeroed before each convolution, so a clip's valid outputs see
    exactly what its own zero padding would give.
    """

    def __init__(self, n_mels: int, dim: int, channels: tuple[int, ...] = (32, 64),
                 sub_bands: int = 4, residual_blocks: int = 2, residual_sub_bands: int = 5,
                 dropout: float = 0.1) -> None:
        super().__init__()
        halvings = len(channels)
        if n_mels % (sub_bands * 2 ** (halvings - 1)) or \
                (residual_blocks and (n_mels >> halvings) % residual_sub_bands):
            raise ValueError(f"n_mels={n_mels} must split into {sub_bands} sub-bands after "
                             f"each of {halvings - 1} halvings of the mel axis, and into "
                             f"{residual_sub_bands} sub-bands after {halvings}")
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        inputs, bands = 1, n_mels
        for width in channels:
            self.convs.append(nn.Conv2d(inputs, width, 3, stride=(1, 2), padding=1, bias=False))
            self.norms.append(SubSpectralNorm(width, sub_bands))
            inputs, bands = width, bands // 2
        self.residuals = nn.ModuleList(BroadcastResidual(inputs, residual_sub_bands, dropout)
                                       for _ in range(residual_blocks))
        self.out = nn.Linear(inputs * bands, dim)

    def forward(self, x: torch.Tensor,
                counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.transpose(1, 2).unsqueeze(1)
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = x * frame_mask(counts, x.shape[3])[:, None, None, :].to(x.dtype)
            x = pair_max(F.gelu(norm(conv(x))), 2)  # F.max_pool2d(., (2, 1)), faster
            counts = (counts + 1) // 2
        mask = frame_mask(counts, x.shape[3])
        for block in self.residuals:
            x = block(x, mask)
        batch, channels, bands, frames = x.shape
        x = x.permute(0, 3, 1, 2).reshape(batch, frames, channels * bands)
        return F.gelu(self.out(x)), counts


def sinusoids(frames: int, dim: int, device: torch.device) -> torch.Tensor:
    """Fixed position encodings: they depend on the position only, not on the batch."""
    position = torch.arange(frames, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32)
                     * (-math.log(10_000.0) / dim))
    table = torch.zeros(frames, dim, device=device)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)
    return table


class EncoderBlock(nn.Module):
    """Pre-norm transformer layer whose attention ignores padded frames."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(),
                                 nn.Linear(mlp_ratio * dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, frames, dim = x.shape
        q, k, v = (self.qkv(self.norm1(x))
                   .view(batch, frames, 3, self.heads, dim // self.heads)
                   .permute(2, 0, 3, 1, 4))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(batch, frames, dim)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class SpeechClassifier(nn.Module):
    """``forward(waves, lengths) -> logits``: log-mel, conv subsampling, transformer,
    masked mean pooling over time, linear classifier."""

    def __init__(self, num_classes: int = 10, sample_rate: int = 8000, n_mels: int = 40,
                 dim: int = 96, depth: int = 3, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.features = LogMel(sample_rate=sample_rate, n_mels=n_mels)
        self.subsample = ConvSubsample(n_mels, dim, dropout=dropout)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, dropout=dropout)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, waves: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        feats, mask = self.features(waves, lengths)
        x, counts = self.subsample(feats, mask.sum(dim=1))
        x = x + sinusoids(x.shape[1], x.shape[2], x.device)
        mask = frame_mask(counts, x.shape[1])
        for block in self.blocks:
            x = block(x, mask)
        weights = mask.unsqueeze(-1).to(x.dtype)
        pooled = (self.norm(x) * weights).sum(dim=1) / counts.to(x.dtype)[:, None]
        return self.head(pooled)
