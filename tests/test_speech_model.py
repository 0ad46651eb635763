"""The speech model: the log-mel front end, sub-spectral norm, the broadcasted residual
blocks, and masking that keeps padding out of a clip's logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from speech_clips import RATE

from gpuflow.models.speech import (
    BroadcastResidual,
    ConvSubsample,
    LogMel,
    SubSpectralNorm,
    mel_filterbank,
)
from gpuflow.workloads import speech


def test_mel_filterbank_covers_the_band_with_unit_peaks() -> None:
    filters = mel_filterbank(129, 40, RATE)
    assert filters.shape == (129, 40) and bool((filters >= 0).all())
    peaks = filters.max(dim=0).values
    assert bool((peaks > 0.5).all()) and bool((peaks <= 1.0).all())
    centres = filters.argmax(dim=0)
    assert bool((centres[1:] >= centres[:-1]).all())


def test_logmel_masks_frames_past_each_clip_and_normalises_them() -> None:
    torch.manual_seed(0)
    waves = torch.randn(2, 1600)
    lengths = torch.tensor([1600, 401])
    feats, mask = LogMel()(waves, lengths)
    assert mask.sum(dim=1).tolist() == [20, 6]
    assert float(feats[1, 6:].abs().max()) == 0.0
    valid = feats[1, :6]
    assert float(valid.mean(dim=0).abs().max()) < 1e-5
    assert math.isclose(float(valid.square().mean()), 1.0, rel_tol=1e-3)


def give_trained_looking_norm_statistics(module: torch.nn.Module) -> None:
    """Random running statistics in every batch norm (one per sub-band in the sub-spectral
    ones), so that evaluation-mode checks do not pass merely because they are 0 and 1."""
    for norm in module.modules():
        if isinstance(norm, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):
            norm.running_mean.uniform_(-1.0, 1.0)
            norm.running_var.uniform_(0.5, 2.0)


def test_sub_spectral_norm_scales_each_frequency_sub_band_on_its_own() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 3, 12, 5)  # (batch, channels, bands, frames)
    x[:, :, :3] *= 100.0  # a loud lowest sub-band must not set the scale of the others
    x[:, :, 9:] += 7.0
    out = SubSpectralNorm(3, sub_bands=4).train()(x)
    per_band = out.reshape(8, 3, 4, 3, 5).permute(1, 2, 0, 3, 4).reshape(3, 4, -1)
    torch.testing.assert_close(per_band.mean(dim=-1), torch.zeros(3, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_band.var(dim=-1, unbiased=False), torch.ones(3, 4),
                               atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="sub-bands"):
        ConvSubsample(n_mels=36, dim=16)
    with pytest.raises(ValueError, match="5 sub-bands after 2"):
        ConvSubsample(n_mels=48, dim=16)


def test_broadcast_residual_keeps_a_clips_frames_apart_from_the_padding() -> None:
    torch.manual_seed(0)
    block = BroadcastResidual(4, sub_bands=5).eval()
    give_trained_looking_norm_statistics(block)
    clip = torch.randn(1, 4, 10, 6)
    padded = torch.cat([clip, 50.0 * torch.randn(1, 4, 10, 3)], dim=3)
    alone = block(clip, torch.ones(1, 6, dtype=torch.bool))
    beside = block(padded, torch.arange(9)[None, :] < 6)
    assert alone.shape == clip.shape
    torch.testing.assert_close(beside[..., :6], alone)
    assert not torch.allclose(alone, F.relu(clip))  # the block changes its input


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_padding_does_not_change_a_clips_logits(size: str) -> None:
    torch.manual_seed(0)
    workload = speech.build(data="synthetic", model_size=size)
    model = workload.model.eval()
    give_trained_looking_norm_statistics(model)
    generator = torch.Generator().manual_seed(5)
    short = 0.3 * torch.randn(1234, generator=generator)
    other = 0.3 * torch.randn(6000, generator=generator)
    items = [((short, torch.tensor(1234)), 0), ((other, torch.tensor(6000)), 1)]
    with torch.no_grad():
        alone = model(*speech.collate_waveforms(items[:1])[0])
        (waves, lengths), _ = speech.collate_waveforms(items)
        assert waves.shape[1] == 6000
        batched = model(waves, lengths)
        moved = model(torch.cat([waves, torch.randn(2, 777)], dim=1), lengths)
    assert alone.shape == (1, 10)
    torch.testing.assert_close(batched[:1], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(moved, batched, atol=1e-5, rtol=0)


def test_model_has_blocks_and_is_deterministic_given_the_seed() -> None:
    torch.manual_seed(3)
    first = speech.build(data="synthetic", model_size="tiny")
    torch.manual_seed(3)
    second = speech.build(data="synthetic", model_size="tiny")
    assert len(first.blocks()) == 2
    for (name, a), (_, b) in zip(first.model.state_dict().items(),
                                 second.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
