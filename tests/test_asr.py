"""The asr workload's pieces: transcripts, manifests, audio decoding and resampling, CTC
decoding and error rates, duration buckets, word timings. No training here: see
tests/test_asr_train.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
import torch.nn.functional as F
from speech_clips import write_wav

from gpuflow.data.audio_file import read_audio, resample
from gpuflow.data.duration_buckets import DurationBuckets, bucket_batches, padding_fraction
from gpuflow.errors import UserError
from gpuflow.input_schema import InputError
from gpuflow.models.asr import ConformerCTC, ConvModule
from gpuflow.workload import IGNORE_INDEX
from gpuflow.workloads.asr import alignable, collate_utterances, ctc_frames_needed, ctc_loss
from gpuflow.workloads.asr_codec import (
    LONGEST_SECONDS,
    TranscriptionCodec,
    chunk_starts,
    join,
    word_timings,
)
from gpuflow.workloads.asr_decode import Lexicon, beam_search, error_counts, error_rate, greedy
from gpuflow.workloads.asr_manifest import Utterance, load_splits, read_manifest
from gpuflow.workloads.asr_text import Vocabulary, normalise
from gpuflow.workloads.speech_codec import SpeechCodec

DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def test_transcripts_are_normalised_by_one_rule() -> None:
    assert normalise("  Four, TWO -- seven!\n") == "four two seven"
    assert normalise("Don't  STOP_now") == "don't stop now"
    assert normalise("Ｆｏｕｒ") == "four"  # NFKC folds full-width letters
    vocabulary = Vocabulary.from_texts(["One two", "TWO"])
    assert vocabulary.symbols == ["<blank>", " ", "e", "n", "o", "t", "w"]
    assert vocabulary.decode(vocabulary.encode("Two, one")) == "two one"
    assert vocabulary.unknown("three") == {"h", "r"}


def test_word_and_character_error_rates_match_hand_counts() -> None:
    # "a b c" -> "a x c d": one substitution, one insertion over three words.
    assert error_counts(["a b c"], ["a x c d"]) == (2, 3)
    assert error_rate(["a b c"], ["a x c d"]) == pytest.approx(2 / 3)
    # Summed over utterances before dividing: (1 deletion + 0) / (2 + 1) words.
    assert error_counts(["one two", "three"], ["one", "three"]) == (1, 3)
    # Normalised first: case and punctuation are not errors.
    assert error_rate(["Four, two."], ["four two"]) == 0.0
    # An empty hypothesis deletes every word; an empty reference pair counts nothing.
    assert error_counts(["one two", ""], ["", ""]) == (2, 2)
    # Characters, spaces included: "seven" -> "seve" is one deletion of five.
    assert error_counts(["seven"], ["seve"], unit="char") == (1, 5)
    assert error_rate(["ab"], ["ba"], unit="char") == 1.0


def test_beam_without_a_lexicon_returns_greedy_at_any_width() -> None:
    torch.manual_seed(0)
    for _ in range(20):
        log_probs = torch.log_softmax(3 * torch.randn(20, 7), dim=-1)
        expected = greedy(log_probs, 20)
        assert beam_search(log_probs, 20, width=1) == expected
        assert beam_search(log_probs, 20, width=8) == expected
    assert greedy(torch.log(torch.tensor([[.1, .9], [.1, .9], [.9, .1], [.1, .9]])), 4) == [1, 1]


def test_the_lexicon_keeps_the_beam_to_whole_words() -> None:
    vocabulary = Vocabulary.from_texts([" ".join(DIGITS)])
    lexicon = Lexicon(DIGITS, vocabulary)
    # Frames spelling "seve" then blanks: greedy writes a non-word, the beam a digit word.
    ids = vocabulary.encode("seve")
    probs = torch.full((8, len(vocabulary)), 0.01)
    for frame, label in enumerate([*ids, 0, 0, 0, 0]):
        probs[frame, label] = 0.9
    probs[4, vocabulary.index["n"]] = 0.3
    log_probs = torch.log(probs / probs.sum(dim=1, keepdim=True))
    assert vocabulary.decode(greedy(log_probs, 8)) == "seve"
    assert vocabulary.decode(beam_search(log_probs, 8, 4, lexicon)) == "seven"
    torch.manual_seed(1)
    noise = torch.log_softmax(2 * torch.randn(40, len(vocabulary)), dim=-1)
    words = vocabulary.decode(beam_search(noise, 40, 8, lexicon)).split()
    assert words and set(words) <= set(DIGITS)


def test_ctc_loss_is_per_character_and_drops_no_batch_to_infinity() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 12, 5)
    frames = torch.tensor([12, 9])
    target = torch.tensor([[1, 2, 3], [4, 4, IGNORE_INDEX]])
    both = ctc_loss({"logits": logits, "frames": frames}, target)
    parts = [ctc_loss({"logits": logits[i:i + 1, :int(frames[i])], "frames": frames[i:i + 1]},
                      target[i:i + 1, :3 - i]) for i in range(2)]
    assert float(both) == pytest.approx(float(parts[0] * 3 + parts[1] * 2) / 5, rel=1e-5)
    assert ctc_frames_needed([4, 4]) == 3 and ctc_frames_needed([1, 2, 3]) == 3
    short = ctc_loss({"logits": logits[:1, :1], "frames": torch.tensor([1])}, target[:1])
    assert torch.isfinite(short)


def test_collate_pads_waves_with_zeros_and_targets_with_ignore_index() -> None:
    items = [((torch.ones(5), torch.tensor(5)), torch.tensor([1, 2])),
             ((torch.ones(3), torch.tensor(3)), torch.tensor([3, 3, 4]))]
    (waves, lengths), targets = collate_utterances(items)
    assert waves.shape == (2, 5) and waves[1, 3:].abs().sum() == 0
    assert lengths.tolist() == [5, 3]
    assert targets.tolist() == [[1, 2, IGNORE_INDEX], [3, 3, 4]]


def test_audio_of_any_rate_and_channels_decodes_to_mono_at_the_model_rate(
        tmp_path: Path) -> None:
    t = np.arange(22050) / 22050
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([tone, tone], axis=1)
    soundfile.write(tmp_path / "a.flac", stereo, 22050)
    wave16k = read_audio(tmp_path / "a.flac", 16000)
    assert wave16k.shape == (16000,) and wave16k.dtype == np.float32
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    assert np.abs(wave16k[200:-200] - expected[200:-200]).max() < 2e-3
    # A tone above the new Nyquist is removed, not folded back.
    high = np.sin(2 * np.pi * 6000 * np.arange(16000) / 16000).astype(np.float32)
    assert np.abs(resample(high, 16000, 8000)[100:-100]).max() < 0.02
    (tmp_path / "bad.wav").write_bytes(b"not audio")
    with pytest.raises(UserError, match="bad.wav is not audio"):
        read_audio(tmp_path / "bad.wav", 16000)


def test_a_bad_manifest_line_stops_the_run_naming_file_and_line(tmp_path: Path) -> None:
    write_wav(tmp_path / "a.wav", np.zeros(800))
    good = json.dumps({"audio_filepath": "a.wav", "text": "one", "duration": 0.1})
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(good + "\n{not json\n")
    with pytest.raises(UserError, match=r"manifest.jsonl, line 2 is not a manifest entry"):
        read_manifest(manifest)
    manifest.write_text(good + "\n\n" + good.replace("a.wav", "gone.wav") + "\n")
    with pytest.raises(UserError, match=r"line 3 names .*gone.wav, which does not exist"):
        read_manifest(manifest)
    manifest.write_text(json.dumps({"audio_filepath": "a.wav", "text": "One!"}) + "\n")
    (utterance,) = read_manifest(manifest)
    assert utterance.duration == pytest.approx(0.1) and utterance.text == "One!"


def test_speakers_are_held_out_whole_and_folders_of_transcripts_are_read(
        tmp_path: Path) -> None:
    lines = []
    for speaker in ("ann", "bob", "cy"):
        for n in range(2):
            write_wav(tmp_path / f"{speaker}{n}.wav", np.zeros(800))
            lines.append(json.dumps({"audio_filepath": f"{speaker}{n}.wav", "text": "one",
                                     "duration": 0.1, "speaker": speaker}))
    (tmp_path / "manifest.jsonl").write_text("\n".join(lines))
    train, val = load_splits(tmp_path)
    assert {u.speaker for u in val} == {"cy"} and {u.speaker for u in train} == {"ann", "bob"}
    _, val = load_splits(tmp_path, "ann,bob")
    assert {u.speaker for u in val} == {"ann", "bob"}
    with pytest.raises(UserError, match="--val-speakers 'dan'"):
        load_splits(tmp_path, "dan")
    folder = tmp_path / "clips"
    folder.mkdir()
    for n in range(10):
        write_wav(folder / f"{n}.wav", np.zeros(1600))
        (folder / f"{n}.txt").write_text(DIGITS[n])
    train, val = load_splits(folder)
    assert len(train) == 9 and [u.text for u in val] == ["nine"]
    assert val[0].duration == pytest.approx(0.2)


def test_duration_buckets_fill_the_budget_and_pad_little() -> None:
    rng = np.random.default_rng(0)
    durations = rng.uniform(0.5, 6.0, 500).tolist() + [40.0]
    batches = bucket_batches(durations, 30.0, seed=0)
    assert sorted(i for b in batches for i in b) == list(range(len(durations)))
    for batch in batches:
        padded = len(batch) * max(durations[i] for i in batch)
        assert padded <= 30.0 or len(batch) == 1  # a clip over the budget rides alone
    assert [500] in batches
    random_batches = [list(range(i, min(i + len(b), 501))) for i, b in
                      zip(np.cumsum([0] + [len(b) for b in batches[:-1]]), batches,
                          strict=True)]
    assert padding_fraction(durations, batches) < 0.1
    assert padding_fraction(durations, batches) < padding_fraction(durations, random_batches)


def test_duration_buckets_resume_by_seed_and_epoch_and_give_ranks_equal_counts() -> None:
    durations = np.random.default_rng(1).uniform(0.5, 6.0, 300).tolist()
    whole = DurationBuckets(durations, 20.0, seed=3)
    again = DurationBuckets(durations, 20.0, seed=3)
    for epoch in (0, 1):
        whole.set_position(epoch, 0)
        run = list(whole)
        again.set_position(epoch, 5)
        assert list(again) == run[5:]  # a resumed epoch draws what the rest would have
    whole.set_position(0, 0)
    first = list(whole)
    whole.set_position(1, 0)
    assert list(whole) != first  # a new order each epoch
    ranks = [DurationBuckets(durations, 20.0, seed=3, rank=r, world_size=3) for r in range(3)]
    counts = {len(r) for r in ranks}
    assert counts == {len(whole.batches) // 3}
    seen = [i for r in ranks for batch in r for i in batch]
    assert len(seen) == len(set(seen))  # no utterance on two ranks in one epoch


def test_word_timings_follow_the_alignment() -> None:
    vocabulary = Vocabulary.from_texts(["one two"])
    o, n, e, space, t, w = (vocabulary.index[c] for c in "one tw")
    path = [0, o, o, n, 0, e, 0, space, 0, 0, t, w, w, o, 0]
    words = word_timings(path, vocabulary, frame_seconds=0.04)
    assert words == [{"word": "one", "start": 0.04, "end": 0.24},
                     {"word": "two", "start": 0.4, "end": 0.56}]
    lexicon = Lexicon(["one"], vocabulary)
    assert lexicon.complete(tuple(vocabulary.encode("one one")))
    assert not lexicon.allows(tuple(vocabulary.encode("on")), space)


def test_long_audio_is_cut_in_its_pauses_and_joined_with_its_timings() -> None:
    rate = 100
    speech = torch.ones(300)
    wave = torch.cat([speech, torch.zeros(40), speech, torch.zeros(40), speech])
    starts = chunk_starts(wave, 400, rate)
    assert starts[0] == 0 and all(b - a <= 400 for a, b in
                                  zip(starts, [*starts[1:], len(wave)], strict=True))
    assert all(wave[s] == 0 for s in starts[1:])  # cut in the silences
    codec = TranscriptionCodec(Vocabulary.from_texts(["one"]), rate, max_seconds=4.0)
    decoded = codec.clips([wave])
    assert [round(offset, 2) for _, offset in decoded.rows] == [s / rate for s in starts]
    assert decoded.key == ("audio", 400)
    parts = [{"text": "one", "duration": 3.2, "words": [{"word": "one", "start": 0.1,
                                                          "end": 0.5}]},
             {"text": "", "duration": 3.4, "words": []},
             {"text": "one", "duration": 3.2, "words": [{"word": "one", "start": 7.0,
                                                          "end": 7.4}]}]
    joined = join(parts)
    assert joined["text"] == "one one" and joined["duration"] == pytest.approx(9.8)
    assert [w["start"] for w in joined["words"]] == [0.1, 7.0]


def test_both_audio_codecs_refuse_empty_and_overlong_clips_by_one_rule() -> None:
    rate = 100
    transcribe = TranscriptionCodec(Vocabulary.from_texts(["one"]), rate, max_seconds=4.0)
    classify = SpeechCodec(10, sample_rate=rate, max_seconds=4.0)
    # Transcription cuts long audio into chunks, up to its limit of 600 s; a classifier
    # takes one clip of at most its 4 s.
    for clips, limit in ((transcribe.clips, LONGEST_SECONDS), (classify._clips, 4.0)):
        assert clips([torch.ones(int(limit * rate))]).rows
        with pytest.raises(InputError, match=rf"a clip of {limit + 0.1:.1f} s is longer "
                           rf"than the {limit:g} s this server takes"):
            clips([torch.ones(5), torch.ones(int(limit * rate) + 10)])
        for empty in ([], [torch.ones(5), torch.ones(0)], [torch.ones(2, 5)]):
            with pytest.raises(InputError, match="each clip must be a non-empty list"):
                clips(empty)


def test_utterances_ctc_cannot_align_or_too_long_are_dropped_with_a_count() -> None:
    vocabulary = Vocabulary.from_texts([" ".join(DIGITS)])
    model = ConformerCTC(len(vocabulary), dim=32, depth=1, heads=2)
    path = Path("unused.wav")
    kept = Utterance(path, 1.0, "seven three")  # 11 characters, 22 frames at 0.9 s
    utterances = [kept, Utterance(path, 40.0, "one"), Utterance(path, 1.0, "?!"),
                  Utterance(path, 0.3, "seven three")]  # 6 frames for 11 characters
    with pytest.warns(UserWarning, match=r"dropped 3 training utterance\(s\): 1 longer "
                      r"than --max-audio-seconds 30, 1 whose transcript needs more CTC "
                      r"frames than the audio has, 1 with an empty transcript"):
        assert alignable(utterances, vocabulary, model, 30.0, "training") == [kept]
    with pytest.raises(UserError, match="no validation utterance is left"), \
            pytest.warns(UserWarning, match="dropped 3 validation"):
        alignable(utterances[1:], vocabulary, model, 30.0, "validation")
    with pytest.raises(UserError, match="lower --batch-seconds"):
        DurationBuckets([1.0, 1.0], 10.0, seed=0, world_size=2)


def test_the_conv_module_is_its_convolutions_with_pointwise_ones_as_products() -> None:
    """The conformer's convolution module computes kernel-1 convs as matrix products and
    runs its depthwise conv outside compiled graphs; the same function of its weights as
    the three Conv1d modules applied in turn, padded frames zeroed before the depthwise."""
    torch.manual_seed(0)
    module = ConvModule(16, 7, dropout=0.0).eval()
    x = torch.randn(3, 20, 16)
    mask = torch.arange(20)[None, :] < torch.tensor([20, 13, 5])[:, None]
    y = F.glu(module.expand(module.norm(x).transpose(1, 2)), dim=1) * mask[:, None, :]
    y = module.project(F.silu(module.batch_norm(module.depthwise(y))))
    torch.testing.assert_close(module(x, mask), y.transpose(1, 2), rtol=1e-5, atol=1e-5)
    explained = torch._dynamo.explain(module)(x, mask)  # traced, not compiled
    assert explained.graph_break_count == 1
    assert "depthwise" in str(explained.break_reasons[0].reason)
