"""Conversations packed several to a window: attention stays inside each (logits equal those
of each conversation alone), the loss stays on the assistant's tokens, `gpuflow data pack`
writes the same windows training builds in memory, a SIGKILLed `gpuflow train
--workload hf:DIR` run on them resumes to the uninterrupted run's weights, and the run
serves /v1/predict on one conversation's token ids alone."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, cli_env, serving
from runs import newest_weights
from test_finetune_chats import CHATS, conversation, write_chats

from gpuflow import checkpoint as ckpt
from gpuflow.cli import main
from gpuflow.model_dir import load_hf_tokenizer
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.model import load_model
from gpuflow.workload import IGNORE_INDEX, resolve_workload
from gpuflow.workloads.chat_windows import collate_windows

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_window_computes_each_conversation_as_alone(
        hub_models: Any, tmp_path: Path, attention: str) -> None:
    chats = [conversation(*CHATS[0]), conversation(*CHATS[2])]
    data = write_chats(tmp_path / "chats", chats)
    workload = resolve_workload(f"hf:{hub_models['llama']}",
                                {"data_dir": str(data), "seq_len": 128})
    assert len(workload.train_dataset) == 1  # both conversations in one window
    inputs, targets = collate_windows([workload.train_dataset[0]])
    tokenizer = load_hf_tokenizer(hub_models["llama"])
    alone = [tokenizer.encode(tokenizer.apply_chat_template(c["messages"], tokenize=False),
                              add_special_tokens=False) for c in chats]
    model = workload.model.eval()
    model.set_attn_implementation(attention)
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        start = 0
        for ids in alone:
            length = len(ids) - 1
            assert inputs["input_ids"][0, start:start + length].tolist() == ids[:-1]
            own = model(input_ids=torch.tensor([ids[:-1]])).logits[0]
            # Measured: at most 6e-6 apart; without the restarting positions, 12.
            assert torch.allclose(packed[start:start + length], own, atol=1e-4, rtol=0)
            start += length
    learned = targets[targets != IGNORE_INDEX].tolist()
    answers = "".join(f"{answer}<|eot_id|>" for _, answer in (CHATS[0], CHATS[2]))
    assert tokenizer.decode(learned) == answers
    assert (targets[0, start:] == IGNORE_INDEX).all()


def test_packed_chats_train_and_a_sigkilled_run_resumes_exactly(
        hub_models: Any, tmp_path: Path) -> None:
    directory = hub_models["llama"]
    data = write_chats(tmp_path / "chats", [conversation(*c) for c in CHATS * 5])
    packed = tmp_path / "packed"
    pack = ["data", "pack", str(data), "--workload", f"hf:{directory}", "--out", str(packed),
            "--seq-len", "128", "--no-progress"]
    assert main(pack) == 0
    assert json.loads((packed / "manifest.json").read_text())["meta"]["seq_len"] == 128
    in_memory = resolve_workload(f"hf:{directory}", {"data_dir": str(data), "seq_len": 128})
    from_pack = resolve_workload(f"hf:{directory}", {"data_dir": str(packed), "seq_len": 128})
    count = len(in_memory.train_dataset)
    assert len(from_pack.train_dataset) == count < 18 / 2  # 18 training conversations
    memory_inputs, memory_targets = collate_windows(list(in_memory.train_dataset))
    pack_inputs, pack_targets = collate_windows([from_pack.train_dataset[i] for i in range(count)])
    assert memory_targets.equal(pack_targets)
    assert all(memory_inputs[key].equal(pack_inputs[key]) for key in memory_inputs)

    common = ["train", "--workload", f"hf:{directory}", "--data-dir", str(packed),
              "--seq-len", "128", "--batch-size", "2", "--max-steps", "40",
              "--checkpoint-every", "4", "--eval-every", "0", "--no-progress"]
    assert main([*common, "--run-dir", str(tmp_path / "reference")]) == 0
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-m", "gpuflow.cli", *common, "--run-dir",
                                str(killed)], env=cli_env(), cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = killed / "checkpoints" / "step-00000004"
    deadline = time.monotonic() + 120
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.kill()
    process.wait()
    steps = [c.step for c in ckpt.list_checkpoints(killed / "checkpoints")]
    assert steps and max(steps) < 40, steps  # killed mid-way
    assert main(["train", "--resume", str(killed), "--no-progress"]) == 0
    reference, resumed = newest_weights(tmp_path / "reference"), newest_weights(killed)
    assert reference.keys() == resumed.keys()
    for name, tensor in reference.items():
        assert torch.equal(tensor, resumed[name]), name
    assert_predicts_from_token_ids(tmp_path / "reference", directory)


def assert_predicts_from_token_ids(run_dir: Path, directory: Path) -> None:
    """A run trained on packed chats (whose batches carry position_ids) is served as any
    causal LM: /v1/predict takes a conversation's input_ids alone, of its own length, and
    answers the trained model's logits."""
    tokenizer = load_hf_tokenizer(directory)
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHATS[1][0]}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    async def predict() -> Any:
        app = create_app(ServeSettings(str(run_dir), device="cpu", max_batch_size=2,
                                       engine_process=False))
        async with serving(app) as client:
            return await client.post("/v1/predict", json={"inputs": {"input_ids": [ids]}})

    reply = asyncio.run(predict())
    assert reply.status_code == 200, reply.text
    logits = torch.tensor(reply.json()["predictions"][0]["outputs"]["logits"])
    model = load_model(run_dir).workload.model.eval()
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([ids])).logits[0]
    assert logits.shape == expected.shape
    assert torch.allclose(logits, expected, atol=1e-5)
