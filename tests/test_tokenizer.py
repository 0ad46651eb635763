"""The Hub-style test directories, and the serving tokenizers over them: encoding with the
family's special tokens, incremental detokenization equal to decoding the whole sequence,
one token's text and bytes, and chat templates."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from hub_models import KINDS, NON_ASCII, SHARDED

PROMPTS = ["Café crème", "東京の", "Hello, who are you?"]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: one torch thread is fastest, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KINDS)
def test_hub_directories_load_offline_and_choose_greedy_tokens_clearly(
    hub_models: Mapping[str, Path], kind: str
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = hub_models[kind]
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    generation = GenerationConfig.from_pretrained(path, local_files_only=True)
    assert model.config.vocab_size == len(tokenizer)
    assert isinstance(generation.eos_token_id, list) and len(generation.eos_token_id) == 2
    assert generation.eos_token_id[0] == tokenizer.eos_token_id
    assert model.config.eos_token_id == generation.eos_token_id
    assert (path / "chat_template.jinja").is_file() == (kind != "gpt2")
    if kind in SHARDED:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 2
    for line in NON_ASCII:
        assert tokenizer.decode(tokenizer.encode(line), skip_special_tokens=True) == line
    margins = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([tokenizer.encode(prompt)]), max_new_tokens=8,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            margins += [float(top[0] - top[1]) for top in
                        (logits[0].topk(2).values for logits in out.logits)]
    assert min(margins) > 1e-3
