"""hf:DIR on JSONL conversations: the loss falls on the assistant's tokens only, found by
the template's generation markers or by its turn-by-turn renderings; a model learns a tiny
chat set and answers it through its export; bad lines and templates are refused."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import serving
from runs import losses

from gpuflow import TrainConfig, train
from gpuflow.errors import UserError
from gpuflow.export import export_model
from gpuflow.model_dir import load_hf_tokenizer
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.workload import IGNORE_INDEX, resolve_workload

CHATS = [("Capital of France?", "Paris."), ("Capital of Japan?", "Tokyo."),
         ("Two plus two?", "Four."), ("Colour of the sky?", "Blue.")]
# LLAMA3_TEMPLATE with the assistant's content and end of turn marked for generation.
MARKED = ("{{- bos_token }}{%- for message in messages %}"
          "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}"
          "{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
          "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def conversation(question: str, answer: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]}


def write_chats(folder: Path, lines: list[Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "chats.jsonl").write_text("".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return folder


def with_template(source: Path, out: Path, template: str) -> Path:
    shutil.copytree(source, out)
    (out / "chat_template.jinja").write_text(template)
    return out


def test_labels_are_the_assistant_tokens_by_markers_and_by_prefixes(
        hub_models: Any, tmp_path: Path) -> None:
    chat = {"messages": [{"role": "user", "content": "Hi there"},
                         {"role": "assistant", "content": "Hello! How can I help?"},
                         {"role": "user", "content": "More"},
                         {"role": "assistant", "content": "Sure."}]}
    data = write_chats(tmp_path / "chats", [chat])
    marked = with_template(hub_models["llama"], tmp_path / "marked", MARKED)
    items = {}
    for name, directory in (("prefixes", hub_models["llama"]), ("markers", marked)):
        workload = resolve_workload(f"hf:{directory}", {"data_dir": str(data), "seq_len": 64})
        items[name] = workload.train_dataset[0]
    tokenizer = load_hf_tokenizer(hub_models["llama"])
    (x, positions), y = items["prefixes"]
    rendered = tokenizer.apply_chat_template(chat["messages"], tokenize=False)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert x[:len(ids) - 1].tolist() == ids[:-1]
    learned = y[y != IGNORE_INDEX].tolist()
    assert tokenizer.decode(learned) == "Hello! How can I help?<|eot_id|>Sure.<|eot_id|>"
    assert (y[len(ids) - 1:] == IGNORE_INDEX).all()  # the padding
    assert positions.tolist() == [*range(len(ids) - 1), *range(64 - len(ids) + 1)]
    assert items["markers"][1].equal(y) and items["markers"][0][0].equal(x)


def test_a_tiny_chat_set_is_learned_and_answered_through_the_export(
        hub_models: Any, tmp_path: Path, one_torch_thread: None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_chats(tmp_path / "chats", [conversation(*c) for c in CHATS * 2])
    spec = f"hf:{hub_models['llama']}"
    torch.manual_seed(0)
    workload = resolve_workload(spec, {"data_dir": str(data), "seq_len": 48})
    train(workload, TrainConfig(workload=spec, data_dir=str(data), seq_len=48, max_steps=60,
                                batch_size=4, lr=1e-2, warmup_steps=0, schedule="constant",
                                eval_every=0, log_every=1, progress=False,
                                run_dir=str(tmp_path / "run")))
    curve = losses(tmp_path / "run")
    # Measured here: from 10.1 to a mean of 0.095 nats per assistant token over the last 5.
    assert sum(curve[-5:]) / 5 < 0.15 and curve[0] > 5
    export_model(tmp_path / "run", tmp_path / "out", format="hf")
    question, answer = CHATS[1]
    messages = conversation(question, "")["messages"][:2]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1]:]
    assert tokenizer.decode(new, skip_special_tokens=True) == answer
    shutil.rmtree(data)  # the server rebuilds the workload without its training data
    assert asyncio.run(served_chat(tmp_path / "out", messages)) == answer


async def served_chat(source: Path, messages: list[dict[str, str]]) -> str:
    """The greedy reply of `gpuflow serve SOURCE` over /v1/chat/completions."""
    app = create_app(ServeSettings(str(source), device="cpu", max_batch_size=2,
                                   engine_process=False))
    async with serving(app) as client:
        reply = await client.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_bad_lines_templates_and_long_conversations_are_refused(
        hub_models: Any, tmp_path: Path) -> None:
    llama = hub_models["llama"]
    cases = [
        ({"text": "no messages"}, r"chats.jsonl:2: no \"messages\" list"),
        ({"messages": [{"role": "robot", "content": "beep"}]},
         r"chats.jsonl:2: message 0 has role 'robot'"),
        ("{oops", r"chats.jsonl:2: not a JSON object"),
    ]
    for number, (line, message) in enumerate(cases):
        data = write_chats(tmp_path / f"bad{number}", [conversation(*CHATS[0]), line])
        with pytest.raises(UserError, match=message):
            resolve_workload(f"hf:{llama}", {"data_dir": str(data), "seq_len": 64})
    data = write_chats(tmp_path / "long", [conversation("word " * 80, "ok")])
    with pytest.raises(UserError, match=r"chats.jsonl:1: the conversation is \d+ tokens, "
                                        r"longer than --seq-len 32 \+ 1.*--truncate-chats"):
        resolve_workload(f"hf:{llama}", {"data_dir": str(data), "seq_len": 32})
    cut = resolve_workload(f"hf:{llama}", {"data_dir": str(data), "seq_len": 32,
                                           "truncate_chats": True})
    assert cut.train_dataset[0][0][0].shape == (32,)
    # A template that numbers the turns it renders: no rendering extends the one before.
    counting = with_template(llama, tmp_path / "counting",
                             "{{ messages | length }}{% for m in messages %}{{ m['content'] }}"
                             "{% endfor %}")
    data = write_chats(tmp_path / "ok", [conversation(*CHATS[0])])
    with pytest.raises(UserError, match="turn 2 does not extend the turns before it"):
        resolve_workload(f"hf:{counting}", {"data_dir": str(data), "seq_len": 64})
