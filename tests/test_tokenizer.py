"""The Hub-style test directories, and the serving tokenizers over them: encoding with the
family's special tokens, incremental detokenization equal to decoding the whole sequence,
one token's text and bytes, and chat templates."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
from hub_models import (
    KINDS,
    NON_ASCII,
    PROMPTS,
    SHARDED,
    build_tokenizer,
    lessons,
    save_tokenizer,
)

from gpuflow.errors import UserError
from gpuflow.serve.generate.tokenizer import (
    BYTE_PIECE,
    CONTEXT,
    MAX_HOLD,
    ByteTokenizer,
    ChatTemplateError,
    Detokenizer,
    HFTokenizer,
    NoChatTemplate,
    Tokenizer,
    load_tokenizer,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# The engine's logits match transformers' within 1e-4 (tests/test_paged_kv.py); a greedy
# choice whose top two logits differ by more than 5x that cannot flip between them. (The
# models' smallest margins are 1.0e-3 (qwen2) to 1.2e-2 on an Intel Xeon; training numerics
# differ between CPUs.)
CLEAR_MARGIN = 5e-4


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
    if kind in SHARDED:  # the same weights as another kind, saved in shards
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 2
        return
    for line in NON_ASCII:
        assert tokenizer.decode(tokenizer.encode(line), skip_special_tokens=True) == line
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                           tokenize=False, add_generation_prompt=True)
             for prompt in PROMPTS] if tokenizer.chat_template else []
    prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]
    prompts += [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]
    margins = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            margins += [float(top[0] - top[1]) for top in
                        (logits[0].topk(2).values for logits in out.logits)]
    assert min(margins) > CLEAR_MARGIN


# --- the serving tokenizers -----------------------------------------------------------------

TEXTS = [*NON_ASCII, "def f(x):\n    return x  # 𝔘🦙 ĳ", "  two leading spaces", "a\n\nb  c",
         "Größe 東京 🚀🔥 👍🏽 数据并行训练 — ok", "tab\there ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", " ", "x"]


@pytest.fixture(scope="module", params=["llama3", "chatml", "mistral", "gpt2", "bytes"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Tokenizer:
    """Each family's tokenizer saved and loaded as a server loads it (no model trained), and
    gpuflow's byte tokenizer."""
    if request.param == "bytes":
        return ByteTokenizer()
    out = tmp_path_factory.mktemp(request.param)
    save_tokenizer(request.param, out)
    return load_tokenizer(out)


def streamed(tokenizer: Tokenizer, prompt: list[int], generated: list[int]) -> str:
    detokenizer = tokenizer.detokenizer(prompt)
    return "".join(detokenizer.add(t) for t in generated) + detokenizer.finish()


def expected(tokenizer: Tokenizer, prompt: list[int], generated: list[int]) -> str:
    return tokenizer.decode(prompt + generated)[len(tokenizer.decode(prompt)):]


def test_streamed_text_is_the_whole_decode_past_the_prompt(tokenizer: Tokenizer) -> None:
    """At every cut of every text into prompt and continuation, and with special tokens
    (EOS, chat markers) among the generated ones; continuations end mid-character too.
    Left out: sequences whose whole decode does not start with the prompt's, which have no
    text past the prompt (a prompt cut mid-character; a byte-fallback run that is not UTF-8
    as a whole decodes wholly to U+FFFD, the prompt's characters too)."""
    rng = random.Random(0)
    specials = sorted(tokenizer.special)
    checked = skipped = 0
    for text in [*TEXTS, *lessons()[:6]]:
        for first, second in ((text, ""), (text[:len(text) // 2], text[len(text) // 2:])):
            tokens = tokenizer.encode(first) + tokenizer.encode(second, add_special_tokens=False)
            if specials:
                tokens.insert(rng.randrange(1, len(tokens) + 1), rng.choice(specials))
            for cut in range(len(tokens) + 1):
                for end in (len(tokens), cut + 1, cut + 2):
                    prompt, generated = tokens[:cut], tokens[cut:end]
                    if not tokenizer.decode(prompt + generated).startswith(
                            tokenizer.decode(prompt)):
                        skipped += 1
                        continue
                    checked += 1
                    assert streamed(tokenizer, prompt, generated) == \
                        expected(tokenizer, prompt, generated), (text, cut, end)
    assert skipped < checked / 3


def test_streamed_text_of_arbitrary_tokens_matches_too(tokenizer: Tokenizer) -> None:
    """Tokens as an untrained model picks them: stray bytes, invalid UTF-8, specials. (Not
    byte-fallback tokens: a full decode turns a run of them that is not UTF-8 wholly into
    U+FFFD, valid bytes too, after the fact, and a stream cannot take back what it sent.)"""
    rng = random.Random(1)
    prompt = tokenizer.encode("Café 東京 ")
    pool = [t for t in range(tokenizer.vocab_size)
            if not (isinstance(tokenizer, HFTokenizer)
                    and BYTE_PIECE.fullmatch(tokenizer.hf.convert_ids_to_tokens(t)))]
    for _ in range(40):
        generated = rng.choices(pool, k=rng.randrange(1, 24))
        assert streamed(tokenizer, prompt, generated) == expected(tokenizer, prompt, generated)


def test_decodes_are_said_to_join_only_where_they_do(tokenizer: Tokenizer,
                                                    request: pytest.FixtureRequest) -> None:
    """Byte-level vocabularies' decodes join (the detokenizer then decodes once a token),
    SentencePiece-style ones' do not (a decode drops its leading space); where said to,
    every cut of every text at a whole character decodes to the halves' decodes joined."""
    family = request.node.callspec.params["tokenizer"]
    assert tokenizer.decodes_join == (family != "mistral")
    if not tokenizer.decodes_join:
        return
    for text in TEXTS:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        for cut in range(len(tokens) + 1):
            first = tokenizer.decode(tokens[:cut])
            if not first.endswith("\ufffd"):
                assert tokenizer.decode(tokens) == first + tokenizer.decode(tokens[cut:])


def test_text_is_sent_as_soon_as_its_characters_are_whole(tokenizer: Tokenizer) -> None:
    detokenizer = tokenizer.detokenizer(tokenizer.encode("Say:"))
    sent = ""
    for token in tokenizer.encode(" 🚀 東京 ok", add_special_tokens=False):
        text = detokenizer.add(token)
        assert "\ufffd" not in text
        sent += text
    assert sent + detokenizer.finish() == " 🚀 東京 ok"
    assert sent.startswith(" 🚀 東京")


def test_detokenizing_decodes_a_bounded_window_per_token() -> None:
    windows: list[int] = []

    def decode(tokens: Sequence[int]) -> str:
        windows.append(len(tokens))
        return bytes(tokens).decode("utf-8", errors="replace")

    for joins in (False, True):
        windows.clear()
        detokenizer = Detokenizer(decode, frozenset(), list(b"x" * 1000), joins)
        added = ("é🚀" * 500).encode()
        text = "".join(detokenizer.add(t) for t in added)
        assert text + detokenizer.finish() == "é🚀" * 500
        assert max(windows) <= CONTEXT + MAX_HOLD
        if joins:  # one decode a token (and the prompt's, and the finish's)
            assert len(windows) == len(added) + 2


def test_tokens_own_bytes_and_text(tokenizer: Tokenizer) -> None:
    """Joined, the bytes of a text's tokens are the text (SentencePiece-style vocabularies
    write the space they prepend to a text that starts with none); a special token's bytes
    are its text."""
    metaspace = isinstance(tokenizer, HFTokenizer) and tokenizer.token_bytes(
        tokenizer.encode("a", add_special_tokens=False)[0]) == b" a"
    for text in TEXTS:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        lead = " " if metaspace and not text.startswith(" ") else ""
        assert b"".join(tokenizer.token_bytes(t) for t in tokens) == (lead + text).encode()
    for token in tokenizer.special:
        assert tokenizer.token_text(token) == tokenizer.hf.convert_ids_to_tokens(token)
        assert tokenizer.token_bytes(token) == tokenizer.token_text(token).encode()


def test_token_text_and_bytes_per_vocabulary_kind() -> None:
    spm = HFTokenizer(build_tokenizer("mistral"))
    byte = spm.hf.convert_tokens_to_ids("<0xE4>")
    assert (spm.token_bytes(byte), spm.token_text(byte)) == (b"\xe4", "\ufffd")
    word = spm.encode("Café", add_special_tokens=False)[0]
    assert spm.token_text(word).startswith(" ")
    bpe = HFTokenizer(build_tokenizer("llama3"))
    rocket = bpe.encode("🚀", add_special_tokens=False)
    assert b"".join(bpe.token_bytes(t) for t in rocket) == "🚀".encode()
    world = bpe.encode(" world", add_special_tokens=False)
    assert "".join(bpe.token_text(t) for t in world) == " world"
    assert bpe.token_text(world[0]).startswith(" ")
    assert ByteTokenizer().token_bytes(0xF0) == b"\xf0"
    assert ByteTokenizer().token_text(ord("a")) == "a"


def test_special_tokens_are_added_as_the_family_adds_them() -> None:
    llama, qwen = HFTokenizer(build_tokenizer("llama3")), HFTokenizer(build_tokenizer("chatml"))
    bos = llama.hf.bos_token_id
    assert llama.encode("hi")[0] == bos and llama.encode("hi", add_special_tokens=False)[0] != bos
    assert qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)
    assert llama.special >= {bos, llama.hf.eos_token_id}
    assert ByteTokenizer().encode("héllo 🚀") == list("héllo 🚀".encode())


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café ?"}]


def test_chat_templates_render_with_the_assistant_turn_open() -> None:
    llama = HFTokenizer(build_tokenizer("llama3"))
    text = llama.render_chat(CHAT)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = llama.encode_chat(CHAT)
    assert ids.count(llama.hf.bos_token_id) == 1 and ids[0] == llama.hf.bos_token_id
    qwen = HFTokenizer(build_tokenizer("chatml"))
    assert qwen.render_chat(CHAT[1:]).endswith("<|im_start|>assistant\n")
    own = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}A:"
    assert qwen.render_chat(CHAT, own) == "system: Be brief.\nuser: Café ?\nA:"
    assert ByteTokenizer().render_chat(CHAT, own) == "system: Be brief.\nuser: Café ?\nA:"


def test_a_template_that_refuses_and_a_missing_one_are_distinct_errors() -> None:
    mistral = HFTokenizer(build_tokenizer("mistral"))
    assert mistral.encode_chat(CHAT[1:])[:2] == mistral.hf.convert_tokens_to_ids(
        ["<s>", "[INST]"])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        mistral.render_chat([*CHAT[1:], *CHAT[1:]])
    with pytest.raises(ChatTemplateError):
        mistral.render_chat(CHAT, "{{ messages[0]['content'] ")
    gpt2 = HFTokenizer(build_tokenizer("gpt2"))
    assert not gpt2.has_chat_template and mistral.has_chat_template
    for no_template in (gpt2, ByteTokenizer()):
        with pytest.raises(NoChatTemplate, match="--chat-template"):
            no_template.render_chat(CHAT)


def test_a_directory_without_a_usable_tokenizer_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="has no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot load the tokenizer"):
        load_tokenizer(tmp_path)


def test_the_byte_tokenizer_a_gpuflow_export_carries_maps_ids_to_bytes(tmp_path: Path) -> None:
    from gpuflow.models.gpt2_format import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.vocab_size == 256
    rng = random.Random(2)
    anything = ["".join(chr(rng.choice([rng.randrange(0xD800), rng.randrange(0xE000, 0x110000)]))
                        for _ in range(12)) for _ in range(50)]
    for text in [*TEXTS, *anything]:
        assert loaded.encode(text) == list(text.encode())
        assert loaded.decode(list(text.encode())) == text
    # 0xFF never occurs in UTF-8: its id is the end-of-document token (gpuflow.byte_vocab)
    assert [loaded.token_bytes(i) for i in range(255)] == [bytes([i]) for i in range(255)]
    assert loaded.token_bytes(255) == b"<|endoftext|>"
    assert loaded.decode([0xE6, 0x9D]) == ByteTokenizer().decode([0xE6, 0x9D]) == "\ufffd"


def _typed_by_users(specials: list[str]) -> list[str]:
    """Text a client may send: whitespace runs, byte-fallback characters, text past the
    256-token model_max_length, and the family's special tokens written out as text, whole,
    cut short and run together."""
    marked = [f"user says {s} then{s}more" for s in specials]
    return [*TEXTS, *lessons()[:6], *marked, "".join(specials), *(s[:-1] for s in specials),
            "", "   ", "\n\n\n", "\t \t x  \n", "京据К🔥 数据", "e\u0301 ﬁ \u2581x \x00\x01",
            "<|im_start|>user\nhi<|im_end|>", "<s>[INST] hi [/INST]", " ".join(lessons()[:8])]


def test_encoding_through_the_rust_backend_gives_transformers_ids(tokenizer: Tokenizer) -> None:
    """The fast path (``backend_tokenizer.encode``) against transformers' own ``encode``,
    with and without the special tokens the family adds (BOS): special tokens a user writes
    in their text are read as those tokens, as transformers reads them."""
    if not isinstance(tokenizer, HFTokenizer):
        return
    assert tokenizer._backend_encode is not None
    specials = sorted({str(t) for t in tokenizer.hf.added_tokens_decoder.values()})
    for text in _typed_by_users(specials):
        for add in (True, False):
            assert tokenizer.encode(text, add_special_tokens=add) == list(
                tokenizer.hf.encode(text, add_special_tokens=add, verbose=False)), (text, add)
    assert len(tokenizer.encode(" ".join(lessons()[:8]))) > tokenizer.hf.model_max_length


def test_a_tokenizer_json_that_truncates_or_pads_does_not_on_the_backend_path(
        tmp_path: Path) -> None:
    """transformers' encode turns off the truncation and padding a tokenizer.json sets;
    so does the backend path."""
    save_tokenizer("llama3", tmp_path)
    path = tmp_path / "tokenizer.json"
    saved = json.loads(path.read_text())
    saved["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                           "stride": 0}
    saved["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                        "pad_id": 0, "pad_type_id": 0, "pad_token": "<|end_of_text|>"}
    path.write_text(json.dumps(saved))
    loaded = load_tokenizer(tmp_path)
    text = "Größe 東京 🚀 and some more words"
    assert loaded.encode(text) == list(loaded.hf.encode(text, verbose=False))
    assert 4 < len(loaded.encode(text)) < 64
