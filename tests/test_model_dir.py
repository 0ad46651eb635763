"""Hugging Face model directories that gpuflow cannot serve are refused before a server
starts, with exit code 2 and the reason: remote code, pickle weights, a missing shard or
tokenizer, a model that is not a causal LM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from gpuflow.cli import main


def gpt2_dir(folder: Path) -> Path:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                       n_positions=32))
    model.save_pretrained(folder)
    return folder


def refused(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["serve", str(path), "--port", "1"]) == 2
    return capsys.readouterr().err


def test_directories_that_cannot_be_served_are_refused_before_serving(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = gpt2_dir(tmp_path / "plain")
    assert "has no tokenizer (tokenizer.json" in refused(plain, capsys)

    remote = gpt2_dir(tmp_path / "remote")
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyModel"}
    (remote / "config.json").write_text(json.dumps(config))
    error = refused(remote, capsys)
    assert "needs remote code" in error and "modeling_mine.MyModel" in error

    pickled = gpt2_dir(tmp_path / "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    assert "never unpickles" in refused(pickled, capsys)

    sharded = gpt2_dir(tmp_path / "sharded")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    assert "model-00002-of-00002.safetensors" in refused(sharded, capsys)

    BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path / "bert")
    assert "not a causal language model (BertLMHeadModel)" in refused(tmp_path / "bert", capsys)

    assert "nor a Hugging Face model directory" in refused(tmp_path, capsys)
