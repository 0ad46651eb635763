"""The speech workload's data: WAV reading, clip names, the speaker split, the refusals,
padding into batches, the example batch and the synthetic clips."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from speech_clips import RATE, synthesise_fsdd, write_wav

from gpuflow.cli import main
from gpuflow.data.audio import find_clips, parse_clip_name, read_wav
from gpuflow.errors import UserError
from gpuflow.workload import check_workload
from gpuflow.workloads import speech

# --- WAV reading -------------------------------------------------------------------------

@pytest.mark.parametrize("width", [1, 2, 4])
def test_read_wav_scales_integer_pcm_to_unit_floats(tmp_path: Path, width: int) -> None:
    samples = np.array([0.0, 0.5, -0.5, 0.25, -1.0], dtype=np.float32)
    path = write_wav(tmp_path / "a.wav", samples, width=width)
    read, rate = read_wav(path, sample_rate=RATE)
    assert rate == RATE and read.dtype == np.float32 and read.shape == (5,)
    np.testing.assert_allclose(read, samples, atol=1 / 2 ** (8 * width - 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rate": 16000}, "16000 Hz; this workload needs 8000 Hz"),
     ({"channels": 2}, "2 channel(s)"),
     ({"width": 3}, "24-bit samples")],
)
def test_read_wav_rejects_other_formats_naming_the_file(tmp_path: Path, kwargs: dict,
                                                        message: str) -> None:
    width = kwargs.pop("width", 2)
    if width == 3:
        path = tmp_path / "odd.wav"
        with wave.open(str(path), "wb") as writer:
            writer.setnchannels(1)
            writer.setsampwidth(3)
            writer.setframerate(RATE)
            writer.writeframes(b"\x00" * 30)
    else:
        channels = kwargs.get("channels", 1)
        path = write_wav(tmp_path / "odd.wav", np.zeros(20 * channels, dtype=np.float32),
                         **kwargs)
    with pytest.raises(UserError, match="odd.wav") as info:
        read_wav(path, sample_rate=RATE, channels=1)
    assert message in str(info.value)


def test_read_wav_rejects_a_file_that_is_not_wav(tmp_path: Path) -> None:
    path = tmp_path / "3_bob_1.wav"
    path.write_bytes(b"ID3 this is an mp3")
    with pytest.raises(UserError, match=r"3_bob_1\.wav is not a readable PCM WAV"):
        read_wav(path)


# --- naming and split ---------------------------------------------------------------------

def test_clip_names_parse_digit_speaker_and_take() -> None:
    assert parse_clip_name("7_jackson_32.wav") == (7, "jackson", 32)
    assert parse_clip_name("0_yweweler_0.WAV") == (0, "yweweler", 0)
    for bad in ("10_jackson_3.wav", "7_jackson.wav", "x_jackson_3.wav", "7_jack_son_3.wav",
                "7_jackson_32.mp3"):
        assert parse_clip_name(bad) is None, bad


def test_takes_0_to_4_are_the_test_set_and_strays_are_counted(tmp_path: Path) -> None:
    folder = tmp_path / "rec"
    folder.mkdir()
    for digit, take in [(3, 0), (3, 4), (3, 5), (8, 2), (8, 10), (8, 49)]:
        write_wav(folder / f"{digit}_amy_{take}.wav",
                  np.full(100 + 10 * take, 0.1 * digit, dtype=np.float32))
    (folder / "README.md").write_text("not audio")
    write_wav(folder / "stray.wav", np.zeros(50, dtype=np.float32))

    clips, unmatched = find_clips(folder)
    assert [(c.digit, c.take) for c in clips] == [(3, 0), (3, 4), (3, 5), (8, 10), (8, 2),
                                                  (8, 49)]
    assert unmatched == ["stray.wav"]

    with pytest.warns(UserWarning, match=r"ignored 1 \.wav file\(s\).*stray\.wav"):
        train, test = speech.load_recordings(folder, val_speakers="none")
    assert sorted(test.labels) == [3, 3, 8] and sorted(train.labels) == [3, 8, 8]
    assert sorted(test.lengths()) == [100, 120, 140]
    assert sorted(train.lengths()) == [150, 200, 590]
    (wave_, length), label = test[0]
    assert wave_.dtype == torch.float32 and length.dtype == torch.int64
    assert int(length) == wave_.shape[0] and label in (3, 8)
    assert torch.allclose(wave_, torch.full_like(wave_, 0.1 * label), atol=1e-4)


def test_whole_speakers_are_held_out_and_never_trained_on(small_fsdd: Path) -> None:
    clips, _ = find_clips(small_fsdd)
    for choice, held in ((None, {"spk1"}), ("spk0", {"spk0"}), (" spk1, spk0 ", None)):
        if held is None:
            with pytest.raises(UserError, match="every speaker"):
                speech.split_clips(clips, choice, small_fsdd)
            continue
        train, val = speech.split_clips(clips, choice, small_fsdd)
        assert {c.speaker for c in val} == held
        assert not {c.speaker for c in train} & held and len(train) + len(val) == len(clips)
    train_set, val_set = speech.load_recordings(small_fsdd)
    assert set(val_set.speakers) == {"spk1"} and set(train_set.speakers) == {"spk0"}
    same_train, same_val = speech.split_clips(clips, "none", small_fsdd)
    assert {c.take for c in same_val} == set(range(5)) and min(c.take for c in same_train) == 5


def train_refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """What `gpuflow train ARGS` (run in this process) printed when it exited 2, as a user
    error, which is said without a traceback (an exception would have propagated here)."""
    assert main(["train", "--workload", "speech", *args]) == 2
    return capsys.readouterr().err


def test_unknown_val_speakers_exit_2_naming_those_present(
        small_fsdd: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stderr = train_refused(capsys, "--data-dir", str(small_fsdd), "--val-speakers",
                           "spk0,bob", "--max-steps", "1", "--run-dir", str(tmp_path / "run"))
    assert "bob is not among the speakers" in stderr
    assert "spk0, spk1" in stderr and "Traceback" not in stderr


def test_no_data_dir_says_where_to_get_the_dataset() -> None:
    with pytest.raises(UserError) as info:
        speech.build()
    message = str(info.value)
    assert "Free Spoken Digit Dataset" in message
    assert "Jakobovski/free-spoken-digit-dataset" in message and "--data-dir" in message


def test_bad_inputs_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="is not a folder"):
        speech.build(data_dir=str(tmp_path / "missing"))
    with pytest.raises(UserError, match="no WAV files named"):
        speech.build(data_dir=str(tmp_path))
    only_train = tmp_path / "train-only"
    only_train.mkdir()
    write_wav(only_train / "1_amy_7.wav", np.zeros(300, dtype=np.float32))
    with pytest.raises(UserError, match=r"no test \(takes 0-4\) recordings"):
        speech.build(data_dir=str(only_train), val_speakers="none")
    with pytest.raises(UserError, match=r"holds out every speaker .*\(amy\).*none"):
        speech.build(data_dir=str(only_train))
    with pytest.raises(UserError, match="tiny, small, base"):
        speech.build(data="synthetic", model_size="huge")


def test_cli_reports_a_bad_wav_by_name_without_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = synthesise_fsdd(tmp_path / "rec", speakers=2, takes=6)
    write_wav(folder / "4_spk0_2.wav", np.zeros(400, dtype=np.float32), rate=44100)
    stderr = train_refused(capsys, "--data-dir", str(folder), "--max-steps", "1",
                           "--run-dir", str(tmp_path / "run"))
    assert "4_spk0_2.wav has a sample rate of 44100 Hz" in stderr
    assert "Traceback" not in stderr


def test_cli_without_data_dir_exits_2_naming_the_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stderr = train_refused(capsys, "--run-dir", str(tmp_path / "run"))
    assert "--data-dir" in stderr and "free-spoken-digit-dataset" in stderr
    assert "Traceback" not in stderr


def test_collate_pads_to_the_longest_clip() -> None:
    items = [((torch.ones(3), torch.tensor(3)), 1), ((torch.full((5,), 2.0), torch.tensor(5)), 4)]
    (waves, lengths), labels = speech.collate_waveforms(items)
    assert waves.shape == (2, 5) and lengths.tolist() == [3, 5] and labels.tolist() == [1, 4]
    assert labels.dtype == torch.int64
    assert waves[0].tolist() == [1, 1, 1, 0, 0] and waves[1].tolist() == [2] * 5
    mixed = [(inputs, torch.eye(10)[label]) for inputs, label in items]
    _, weights = speech.collate_waveforms(mixed)
    assert weights.shape == (2, 10) and weights.argmax(dim=1).tolist() == [1, 4]


def test_example_batch_depends_on_lengths_not_file_order(small_fsdd: Path) -> None:
    train, _ = speech.load_recordings(small_fsdd)
    example = speech.example_batch(train)
    order = np.random.default_rng(0).permutation(len(train))
    shuffled = speech.WaveformDataset([train.waves[i] for i in order],
                                      [train.labels[i] for i in order])
    again = speech.example_batch(shuffled)
    (waves, lengths), labels = example
    assert waves.shape[0] == 8 and lengths.tolist() == sorted(lengths.tolist())
    assert waves.shape[1] >= float(np.median(train.lengths()))
    assert torch.equal(again[0][1], lengths) and torch.equal(again[0][0], waves)


def test_synthetic_data_has_the_workloads_shapes_and_depends_only_on_index() -> None:
    workload = speech.build(data="synthetic")
    check_workload(workload)
    assert len(workload.train_dataset) == 2250 and len(workload.val_dataset) == 250
    (wave_, length), label = workload.train_dataset[17]
    (again, _), label_again = workload.train_dataset[17]
    assert torch.equal(wave_, again) and label == label_again
    assert 1200 <= int(length) <= 8000 and wave_.shape == (int(length),) and 0 <= label < 10
    lengths = workload.train_dataset.lengths()
    assert lengths[17] == int(length) and len(set(lengths)) > 100
