"""gpuflow data pack --tokenizer: documents tokenized as the tokenizer encodes them, EOS
between them, in the narrowest token width, in bounded memory, resumable; old byte packs
still read."""

from __future__ import annotations

import json
import tracemalloc
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from hub_models import lessons, write_corpus

from gpuflow.cli import main
from gpuflow.data import tokenize_pack
from gpuflow.data.manifest import MANIFEST, load_manifest
from gpuflow.data.pack import write_pack
from gpuflow.data.streaming import open_packed
from gpuflow.data.text_pieces import corpus_pieces
from gpuflow.data.tokenize_pack import TokenizedSource, token_dtype
from gpuflow.errors import UserError
from gpuflow.model_dir import load_hf_tokenizer
from gpuflow.workloads.packing import pack
from gpuflow.workloads.text_tokens import tokenizer_spec


def tokens(directory: Path, split: str) -> np.ndarray:
    manifest = load_manifest(directory)
    return np.concatenate([np.load(directory / shard.file) for shard in manifest.splits[split]])


def test_packing_equals_encode_per_document_plus_eos(tmp_path: Path, hub_models) -> None:
    train, val = write_corpus(tmp_path / "corpus")
    model = hub_models["llama"]
    packed = {}
    for workers in (0, 2):  # in this process, and in two worker processes
        out = tmp_path / f"packed-{workers}"
        pack(f"hf:{model}", tmp_path / "corpus", out, shard_mb=1e-6, progress=False,
             text_field="body", workers=workers)
        packed[workers] = out
    hf = load_hf_tokenizer(model)
    for split, documents in (("train", train), ("val", val)):
        expected = [i for doc in documents for i in [*hf.encode(doc), hf.eos_token_id]]
        assert hf.encode(documents[0])[0] == hf.bos_token_id  # the tokenizer's own BOS kept
        for out in packed.values():
            assert tokens(out, split).tolist() == expected
    one, two = (load_manifest(packed[w]) for w in (0, 2))
    assert one.splits == two.splits and len(one.splits["train"]) > 1
    assert one.token_dtype == "uint16" and one.meta["vocab_size"] == len(hf)
    data = open_packed(packed[0], "textlm", seq_len=16)
    assert data is not None and data.val is not None
    x, y = data.train[0]
    assert x.tolist() == tokens(packed[0], "train")[:16].tolist() and y[:-1].equal(x[1:])


def test_uint32_exactly_when_the_vocabulary_needs_it(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert [token_dtype(n) for n in (256, 65_536, 65_537)] == ["uint16", "uint16", "uint32"]
    vocab = {f"w{i}": i for i in range(70_000)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w1").save_pretrained(
        tmp_path / "words")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("w69999 w65536 w7 " * 20)
    pack("textlm", tmp_path / "text", tmp_path / "out", progress=False,
         tokenizer=tmp_path / "words", workers=0)
    assert load_manifest(tmp_path / "out").token_dtype == "uint32"
    assert tokens(tmp_path / "out", "train")[:4].tolist() == [69999, 65536, 7, 69999]


def test_memory_stays_below_a_cap_smaller_than_the_corpus(tmp_path: Path, hub_models) -> None:
    corpus = tmp_path / "big"
    corpus.mkdir()
    line = "\n".join(json.dumps({"text": text}) for text in lessons()) + "\n"
    (corpus / "a.jsonl").write_text(line * (5 * 2**20 // len(line) + 1))
    source = TokenizedSource("textlm", corpus_pieces(corpus, piece_bytes=32 * 2**10),
                             tokenizer_spec(hub_models["llama"]))
    cap = 7 * 2**18  # 1.75 MiB: a 1 MiB hashing buffer, a shard, pieces in flight
    tracemalloc.start()
    try:
        manifest = write_pack("textlm", corpus, tmp_path / "out", lambda *_: source,
                              shard_mb=0.125, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    stored = 2 * (manifest.count("train") + manifest.count("val"))
    assert peak < cap < stored < (corpus / "a.jsonl").stat().st_size, (peak, stored)


def test_an_interrupted_pack_resumes_after_its_finished_shards(
        tmp_path: Path, hub_models, monkeypatch: pytest.MonkeyPatch) -> None:
    write_corpus(tmp_path / "corpus")
    run = partial(pack, "textlm", tmp_path / "corpus", shard_mb=1e-6, progress=False,
                  tokenizer=hub_models["llama"], text_field="body", workers=0)
    whole = run(tmp_path / "whole")
    encode, calls, interrupted = tokenize_pack.encode_piece, [], []

    def failing(*args: object, **kwargs: object) -> object:
        calls.append(args)
        if len(calls) == 3 and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenize_pack, "encode_piece", failing)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed")
    calls.clear()
    resumed = run(tmp_path / "resumed")
    assert resumed.splits == whole.splits
    total = sum(piece.in_split(s) for piece in corpus_pieces(tmp_path / "corpus")
                for s in ("train", "val"))
    assert len(calls) == total - 2  # the two pieces of the kept shards are not read again


def test_bad_jsonl_lines_name_their_file_and_line(tmp_path: Path, hub_models,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "d.jsonl").write_text('{"text": "fine"}\n\n{"txt": "oops"}\n')
    args = ["data", "pack", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--workload",
            "textlm", "--tokenizer", str(hub_models["llama"]), "--workers", "0",
            "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "d.jsonl:3: no string field 'text' (found 'txt')" in err and "--text-field" in err
    (tmp_path / "c" / "d.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(UserError, match=r"d.jsonl:2: not a JSON object"):
        pack("textlm", tmp_path / "c", tmp_path / "o2", progress=False,
             tokenizer=hub_models["llama"], workers=0)
    with pytest.raises(UserError, match="--text-field and --workers apply to packing under a"):
        pack("textlm", tmp_path / "c", tmp_path / "o3", progress=False, text_field="x")
    with pytest.raises(UserError, match="hf:DIR packs text under DIR's own tokenizer"):
        pack(f"hf:{hub_models['llama']}", tmp_path / "c", tmp_path / "o4", progress=False,
             tokenizer=hub_models["llama"])


def test_byte_packs_of_format_version_1_still_read(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("hello, packed bytes " * 40)
    pack("textlm", tmp_path / "t", tmp_path / "p", progress=False)
    path = tmp_path / "p" / MANIFEST
    saved = json.loads(path.read_text())
    assert saved.pop("token_dtype") == "uint8" and saved["format_version"] == 2
    path.write_text(json.dumps({**saved, "format_version": 1}))  # as version 1 wrote it
    data = open_packed(tmp_path / "p", "textlm", seq_len=8)
    assert data is not None
    assert bytes(data.train[0][0].tolist()) == b"hello, p"
