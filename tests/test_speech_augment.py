"""Speech augmentation: a function of seed, epoch and index, mixup, speed, noise and the
high-pass; the same batches with loader workers and after a killed run resumes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from conftest import ROOT, cli_env, run_cli, sigkill_at_gate
from runs import newest_weights

from gpuflow.data.augment import AugmentedDataset
from gpuflow.data.loader import train_batches
from gpuflow.workloads import speech, speech_augment


def test_augmentation_is_a_function_of_seed_epoch_and_index(small_fsdd: Path) -> None:
    train, _ = speech.load_recordings(small_fsdd)
    augmented = AugmentedDataset(train, speech.WaveAugment(), seed=3)
    (wave_, length), label = augmented[(1, 4)]
    (again, again_length), again_label = augmented[(1, 4)]
    assert torch.equal(wave_, again) and int(length) == int(again_length) == wave_.shape[0]
    assert label == again_label == train.labels[4]
    (raw, raw_length), _ = train[4]
    assert wave_.shape != raw.shape or not torch.equal(wave_, raw)
    others = [augmented[(2, 4)][0][0], AugmentedDataset(train, speech.WaveAugment(),
                                                        seed=4)[(1, 4)][0][0]]
    for other in others:
        assert other.shape != wave_.shape or not torch.equal(other, wave_)
    assert int(length) != int(raw_length)  # the speed and the delay change its length


def test_mixup_mixes_two_perturbed_clips_and_their_labels(small_fsdd: Path) -> None:
    train, _ = speech.load_recordings(small_fsdd)
    mixup = speech.ClipMixup(train, speech.WaveAugment(), num_classes=10)
    augmented = AugmentedDataset(train, mixup, seed=3)
    (wave_, length), target = augmented[(1, 4)]
    (again, _), again_target = augmented[(1, 4)]
    assert torch.equal(wave_, again) and torch.equal(target, again_target)
    assert wave_.shape == (int(length),) and target.shape == (10,) and target.dtype == torch.float32
    assert math.isclose(float(target.sum()), 1.0, rel_tol=1e-6)
    assert float(target[train.labels[4]]) > 0.0  # the item's own label keeps its share
    shares = []
    for index in range(len(train)):
        _, target = augmented[(0, index)]
        shares.append(float(target[train.labels[index]]))
    # Beta(0.4, 0.4) shares: mostly near 0 or 1, and a partner of another digit most times.
    assert 0.3 < np.mean(shares) < 0.9 and min(shares) < 0.5 < max(shares)
    # The same item, drawn again in the next epoch or under another seed, is mixed anew.
    for other in (augmented[(2, 4)], AugmentedDataset(train, mixup, seed=4)[(1, 4)]):
        assert other[0][0].shape != wave_.shape or not torch.equal(other[0][0], wave_)


def test_mixup_levels_both_clips_before_mixing() -> None:
    loud, quiet = torch.full((4,), 3.0), torch.full((6,), 0.01)
    assert torch.allclose(speech_augment.unit_rms(loud), torch.ones(4))
    assert torch.allclose(speech_augment.unit_rms(quiet), torch.ones(6))
    assert torch.equal(speech_augment.unit_rms(torch.zeros(3)), torch.zeros(3))

    class OnePartner(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, index: int):
            return (quiet, torch.tensor(6)), 7

    still = speech.WaveAugment(speed=(1.0, 1.0), max_delay_s=0.0, snr_db=(300.0, 300.0),
                               high_pass_probability=0.0)
    mixup = speech.ClipMixup(OnePartner(), still, num_classes=10)
    rng = np.random.default_rng(0)
    (mixed, length), target = mixup(((loud, torch.tensor(4)), 2), rng)
    share = float(target[2])
    assert int(length) == 6 and math.isclose(share + float(target[7]), 1.0, rel_tol=1e-6)
    torch.testing.assert_close(mixed, torch.tensor([1.0] * 4 + [1.0 - share] * 2))


def test_speed_perturbation_resamples_and_noise_has_the_asked_snr() -> None:
    signal = np.sin(np.arange(800) / 5.0)
    faster = speech.WaveAugment.perturb_speed(signal, 1.25)
    assert faster.shape == (640,)
    np.testing.assert_allclose(faster[::4], signal[::5], atol=1e-12)
    noise = speech.WaveAugment.noise(signal, 20.0, np.random.default_rng(0))
    assert math.isclose(np.mean(signal**2) / np.mean(noise**2), 100.0, rel_tol=0.15)


def test_high_pass_removes_the_low_band_and_keeps_the_rest() -> None:
    rate, seconds = 8000, 0.5
    times = np.arange(int(rate * seconds)) / rate
    hum, vowel = np.sin(2 * np.pi * 60.0 * times), np.sin(2 * np.pi * 1000.0 * times)
    filtered = speech.WaveAugment.high_pass(hum + vowel, 200.0, rate)
    np.testing.assert_allclose(filtered, vowel, atol=1e-9)  # both tones fit whole periods
    half_way = speech.WaveAugment.high_pass(np.sin(2 * np.pi * 150.0 * times), 200.0, rate)
    assert math.isclose(np.abs(half_way).max(), 0.5, rel_tol=1e-6)  # the linear fade

    always = speech.WaveAugment(speed=(1.0, 1.0), max_delay_s=0.0, snr_db=(300.0, 300.0),
                                high_pass_probability=1.0, high_pass_hz=(200.0, 200.0))
    item = ((torch.from_numpy(hum + vowel).float(), torch.tensor(times.shape[0])), 3)
    (wave_, length), label = always(item, np.random.default_rng(0))
    assert label == 3 and int(length) == times.shape[0]
    np.testing.assert_allclose(wave_.numpy(), vowel, atol=1e-5)


def test_augmented_batches_do_not_depend_on_workers_and_resume_in_place(
        small_fsdd: Path) -> None:
    train, _ = speech.load_recordings(small_fsdd)
    augment = speech.WaveAugment()

    def batches(start: int, workers: int, count: int) -> list:
        stream = train_batches(train, 8, speech.collate_waveforms, seed=1, start_batch=start,
                               num_workers=workers, pin_memory=False, augment=augment)
        return [next(stream) for _ in range(count)]

    whole = batches(0, 0, 5)
    for got, want in zip(batches(0, 2, 5) + batches(3, 0, 2), whole + whole[3:], strict=True):
        assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[1], want[1])
    plain = next(train_batches(train, 8, speech.collate_waveforms, seed=1, start_batch=0,
                               num_workers=0, pin_memory=False))
    assert torch.equal(plain[1], whole[0][1])  # the same samples, in the same order
    assert not torch.equal(plain[0][1], whole[0][0][1])  # but augmented


def test_killed_augmented_run_resumes_to_the_same_weights(small_fsdd: Path,
                                                          tmp_path: Path) -> None:
    n = 6
    common = ["train", "--workload", "user_workloads:gated_speech", "--data-dir",
              str(small_fsdd), "--max-steps", str(2 * n), "--checkpoint-every", str(n),
              "--eval-every", "0", "--batch-size", "16", "--no-progress"]
    env = cli_env(OMP_NUM_THREADS="1")
    reference = tmp_path / "reference"
    assert run_cli(*common, "--run-dir", str(reference), env=env).returncode == 0
    run_dir = tmp_path / "killed"
    gate = run_dir / "checkpoints" / f"step-{n:08d}"
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuflow.cli", *common, "--run-dir", str(run_dir)],
        env={**env, "GATE_CHECKPOINT": str(gate)}, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    sigkill_at_gate(process, gate)
    result = run_cli("train", "--resume", str(run_dir), "--no-progress", env=env)
    assert result.returncode == 0, result.stderr
    # The weight average (speech's default) resumes too: the final weights are its.
    assert json.loads((run_dir / "summary.json").read_text())["ema_decay"] == 0.99
    final = [newest_weights(d) for d in (reference, run_dir)]
    assert final[0].keys() == final[1].keys()
    for name, tensor in final[0].items():
        assert torch.equal(tensor, final[1][name]), name
