"""Model directories laid out as the Hugging Face Hub lays them out, built offline in seconds.

No wheel ships a real model or tokenizer, so tests and benchmarks build their own: tokenizers
trained with the ``tokenizers`` library on the Python docs bundled with CPython (plus a few
lines of accented, CJK and emoji text), saved beside tiny config-built models trained a few
dozen steps, so that greedy choices are not near-ties. Each directory holds what a Hub
download holds: ``config.json``, safetensors weights (sharded with an index for
``llama-sharded``), ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``
(all but GPT-2) and ``generation_config.json`` with two EOS ids. Builds are seeded, so a
kind's directory is the same on every run.

    build_hub_model("llama", tmp / "llama")   # one kind
    build_all(tmp)                            # every kind in KINDS
    HubModels(tmp)["qwen2"]                   # built on first use, then cached
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

# Text no English help page has, seen often enough that tokenizers learn merges for it.
NON_ASCII = (
    "Café crème à Noël — naïve façade",
    "Größe, Übermaß und Fußgängerübergänge",
    "L'été dernier, où êtes-vous allés ?",
    "Ça coûte 12 € ; déjà payé.",
    "東京の天気は晴れです",
    "今日は良い天気ですね。",
    "数据并行训练",
    "模型在两个核心上训练。",
    "서울의 날씨는 맑습니다",
    "Привет, мир! Как дела?",
    "🚀🔥 ok 👍🏽",
    "naïve résumé ✓ — “quoted” «texte»",
)
# Prompts on which every kind's greedy choices are clear (top-1 minus top-2 logit at least
# 5e-3 over 32 tokens, plain and through the chat template): tests comparing two
# implementations token for token use these. Greedy, llama and mistral end some of them at
# their first EOS id and some at their second (mistral's chat on "Größe": at once).
PROMPTS = ("Hello, who are you?", "東京の天気", "Größe", "🚀", "naïve", "L'été",
           "A target occurring", "Assert statements")
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}"
    "{{- raise_exception('Only user and assistant roles are supported, with the exception of"
    " an initial optional system message!') }}"
    "{%- endif %}"
    "{%- endfor %}"
)


@dataclass(frozen=True)
class Family:
    """A tokenizer family's conventions: its vocabulary kind, special tokens (appended after
    the learned vocabulary, as Llama 3 and Qwen2 place theirs, or first, as SentencePiece
    does), which of them are BOS, the two EOS and padding, its chat template, and the
    ``tokenizer_class`` its Hub directories name."""

    vocab: Literal["bpe", "spm"]
    specials: tuple[str, ...]
    bos: str | None
    eos: tuple[str, str]  # generation_config's EOS ids; the first is the tokenizer's eos_token
    pad: str | None
    add_bos: bool
    template: str | None
    tokenizer_class: str


FAMILIES = {
    # Three reserved tokens, as Llama 3 keeps, round the vocabulary to 4,096.
    "llama3": Family("bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                             "<|end_header_id|>", "<|eot_id|>",
                             *(f"<|reserved_special_token_{i}|>" for i in range(3))),
                     bos="<|begin_of_text|>", eos=("<|eot_id|>", "<|end_of_text|>"),
                     pad="<|end_of_text|>", add_bos=True, template=LLAMA3_TEMPLATE,
                     tokenizer_class="PreTrainedTokenizerFast"),
    "chatml": Family("bpe", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None,
                     eos=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>", add_bos=False,
                     template=CHATML_TEMPLATE, tokenizer_class="Qwen2Tokenizer"),
    # Mistral's v3 vocabulary has [INST] as a control token: generating it starts a new turn.
    "mistral": Family("spm", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), bos="<s>",
                      eos=("</s>", "[INST]"), pad=None, add_bos=True, template=MISTRAL_TEMPLATE,
                      tokenizer_class="LlamaTokenizer"),
    "gpt2": Family("bpe", ("<|endoftext|>", "<|endofprompt|>"), bos="<|endoftext|>",
                   eos=("<|endoftext|>", "<|endofprompt|>"), pad=None, add_bos=False,
                   template=None, tokenizer_class="GPT2Tokenizer"),
}
BPE_VOCAB = 4096 - 8  # learned tokens; each family's specials come on top
SPM_VOCAB = 2048
# Characters the SentencePiece-style vocabulary never learns, so that models see and write
# them as byte-fallback tokens (<0xE4> <0xBA> <0xAC> for 京).
BYTE_FALLBACK = "京据К🔥"


@dataclass(frozen=True)
class Spec:
    """One kind of directory: a model type with its tokenizer family, its config fields
    beyond the shared tiny sizes, and its generation defaults."""

    model_type: str
    family: str
    config: dict[str, Any]
    sampling: dict[str, Any] = field(default_factory=dict)


# hidden 64, 2 layers, 4 heads over 2 key/value heads (grouped-query), MLP 128, 256 positions.
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 256}
SPECS = {
    "llama": Spec("llama", "llama3", TINY, sampling={"do_sample": True, "temperature": 0.6,
                                                    "top_p": 0.9}),
    "qwen2": Spec("qwen2", "chatml", {**TINY, "tie_word_embeddings": True},
                  sampling={"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}),
    # A window shorter than the prompts tests send.
    "mistral": Spec("mistral", "mistral", {**TINY, "sliding_window": 32}),
    "gpt2": Spec("gpt2", "gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128,
                                  "n_positions": 256}),
}
# Kinds that save another kind's trained model in shards: (that kind, shard size).
SHARDED = {"llama-sharded": ("llama", "300KB")}
KINDS = (*SPECS, *SHARDED)
SEED = 0
# Enough for the models to recite bits of their lessons and end turns with either EOS.
STEPS, BATCH, WINDOW, LR = 80, 8, 64, 1e-2


@functools.cache
def corpus() -> tuple[str, ...]:
    """What tokenizers learn from: the paragraphs of CPython's bundled help topics, then the
    non-ASCII lines, each repeated so that tokenizers learn merges for them."""
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for name in sorted(topics) for p in topics[name].split("\n\n")]
    return tuple(p for p in paragraphs if p) + NON_ASCII * 40


@functools.cache
def lessons() -> tuple[str, ...]:
    """What models learn from, small enough to learn in seconds: the first short prose
    paragraph of every eighth help topic, and the non-ASCII lines."""
    from pydoc_data.topics import topics

    prose = []
    for name in sorted(topics)[::8]:
        blocks = [b.strip() for b in topics[name].split("\n\n")[1:]]
        prose += [b for b in blocks if 60 < len(b) < 300 and b[0] != " " and "*" not in b][:1]
    return (*prose, *NON_ASCII)


@functools.cache
def learned_vocabulary(vocab: Literal["bpe", "spm"]) -> str:
    """The learned tokenizer of a vocabulary kind (no special tokens yet), as JSON; cached
    because three families share the byte-level one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(corpus(), trainer)
        return tokenizer.to_str()
    # SentencePiece's layout: <unk> <s> </s>, the 256 byte-fallback tokens, the merges.
    # Words are split at spaces while learning, so that no merge spans one; in use the text
    # stays one piece (split=False), as Llama's and Mistral's tokenizers keep it.
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    unseen = str.maketrans(dict.fromkeys(BYTE_FALLBACK))
    learner.train_from_iterator((text.translate(unseen) for text in corpus()), trainers.BpeTrainer(
        vocab_size=SPM_VOCAB - 256, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    spec = json.loads(learner.to_str())
    learned = spec["model"]["vocab"]
    ordered = sorted(learned, key=learned.__getitem__)
    pieces = [*ordered[:3], *(f"<0x{b:02X}>" for b in range(256)), *ordered[3:]]
    spec["model"].update(vocab={p: i for i, p in enumerate(pieces)}, byte_fallback=True,
                         fuse_unk=True)
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tokenizer.to_str()


@functools.cache
def build_tokenizer(family: str) -> Any:
    """The family's ``PreTrainedTokenizerFast``: the learned vocabulary, its special tokens,
    a post-processor that adds BOS where the family does, and its chat template. Cached and
    shared: do not change it."""
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tokenizer = Tokenizer.from_str(learned_vocabulary(spec.vocab))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in spec.specials])
    if spec.add_bos:
        assert spec.bos is not None
        bos = (spec.bos, tokenizer.token_to_id(spec.bos))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[bos])
    elif spec.vocab == "bpe":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=spec.bos, eos_token=spec.eos[0],
        pad_token=spec.pad, unk_token="<unk>" if spec.vocab == "spm" else None,
        model_max_length=256, clean_up_tokenization_spaces=False)
    if spec.template is not None:
        wrapped.chat_template = spec.template
    return wrapped


@functools.cache
def token_stream(family: str) -> torch.Tensor:
    """The lessons as one stream of ids. Each ends with one of the two EOS tokens in turn;
    for a family with a chat template, every third is a user turn answered by the next one,
    so that models learn to end both documents and turns."""
    spec, tokenizer = FAMILIES[family], build_tokenizer(family)
    eos = tokenizer.convert_tokens_to_ids(list(spec.eos))
    documents = lessons()
    ids: list[int] = []
    for i, document in enumerate(documents):
        if spec.template is not None and i % 3 == 0:
            chat = [{"role": "user", "content": document},
                    {"role": "assistant", "content": documents[(i + 1) % len(documents)]}]
            ids += tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False),
                                    add_special_tokens=False)
        else:
            ids += tokenizer.encode(document) + [eos[i % 2]]
    return torch.tensor(ids)


@contextmanager
def one_thread() -> Iterator[None]:
    """Models this small run fastest on one torch thread, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def train_model(kind: str) -> Any:
    """The kind's tiny model, built from its config and trained ``STEPS`` steps of AdamW on
    random windows of its family's token stream (next-token loss), seeded. Cached and
    shared (the sharded kinds save it again): do not change it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = SPECS[kind]
    family, tokenizer = FAMILIES[spec.family], build_tokenizer(spec.family)
    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in
           (("bos_token_id", family.bos), ("pad_token_id", family.pad)) if t is not None}
    eos = tokenizer.convert_tokens_to_ids(list(family.eos))
    config = AutoConfig.for_model(spec.model_type, vocab_size=len(tokenizer),
                                  eos_token_id=eos, **ids, **spec.config)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    stream = token_stream(spec.family)
    generator = torch.Generator().manual_seed(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    with one_thread():
        model.train()
        for _ in range(STEPS):
            starts = torch.randint(len(stream) - WINDOW, (BATCH,), generator=generator)
            batch = torch.stack([stream[s:s + WINDOW] for s in starts.tolist()])
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.generation_config.update(**ids, eos_token_id=eos, **spec.sampling)
    return model.eval()


def build_hub_model(kind: str, out: Path) -> Path:
    """Build the ``kind`` directory (one of ``KINDS``) into ``out``; returns ``out``."""
    trained, shard_size = SHARDED.get(kind, (kind, None))
    out.mkdir(parents=True, exist_ok=True)
    train_model(trained).save_pretrained(
        out, **({"max_shard_size": shard_size} if shard_size else {}))
    save_tokenizer(SPECS[trained].family, out)
    return out


def save_tokenizer(family: str, out: Path) -> None:
    """Save the family's tokenizer into ``out``, naming the class its Hub directories name
    (transformers writes the class it built) so that loading takes the same path."""
    build_tokenizer(family).save_pretrained(out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "tokenizer_class": FAMILIES[family].tokenizer_class},
                               indent=2) + "\n")


def build_all(root: Path) -> dict[str, Path]:
    """Every kind in ``KINDS``, each in ``root / kind``."""
    return {kind: build_hub_model(kind, root / kind) for kind in KINDS}


class HubModels(Mapping[str, Path]):
    """The kinds' directories under ``root``, each built on first use and then reused, so a
    test session pays only for the kinds its tests use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def __getitem__(self, kind: str) -> Path:
        if kind not in KINDS:
            raise KeyError(kind)
        if kind not in self._built:
            self._built[kind] = build_hub_model(kind, self.root / kind)
        return self._built[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(KINDS)

    def __len__(self) -> int:
        return len(KINDS)


def write_corpus(root: Path) -> tuple[list[str], list[str]]:
    """Three text files and a JSONL of 25 lines; the train and val documents, in order
    (file 1 of 3 is held out, and JSONL lines 10 and 20)."""
    root.mkdir(parents=True, exist_ok=True)
    texts = list(lessons())
    files = texts[:3]
    for i, text in enumerate(files):
        (root / f"{i}.md").write_text(text)
    records = [f"{i}: {text}" for i, text in enumerate((texts * 2)[3:28])]
    with open(root / "z.jsonl", "w") as handle:
        for text in records:
            handle.write(json.dumps({"body": text, "id": 1}) + "\n")
    val_lines = {9, 19}
    train = [files[0], files[2]] + [t for i, t in enumerate(records) if i not in val_lines]
    val = [files[1]] + [records[i] for i in sorted(val_lines)]
    return train, val
