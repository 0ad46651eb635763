"""`gpuflow serve DIR` on Hugging Face model directories as the Hub lays them out (the
shared ``hub_models`` fixture: a Llama-3-style byte-level BPE and a Mistral-style
metaspace/byte-fallback tokenizer, chat templates, two EOS ids), through the official
``openai`` client: greedy completions and chats equal transformers' ``generate`` on the same
directory, token for token, non-ASCII text included; log-probabilities equal transformers'
logits; stops, seeds, EOS ids and bad requests behave as OpenAI's API says."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from conftest import cli_env, serving
from transformers import AutoModelForCausalLM, AutoTokenizer

import gpuflow

PROMPT = "Café crème, 東京 🚀: the for statement"
# Prompts the fixture's models answer with accents, CJK or emoji.
NON_ASCII_PROMPT = "Café crème à"
NON_ASCII_CHAT = [{"role": "user", "content": "Café crème à Noël"}]
CHAT = [{"role": "system", "content": "Réponds brièvement."},
        {"role": "user", "content": "Explain the with statement 👍🏽"}]
TOKENS = 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Reference:
    """transformers' own answers on a directory: its tokenizer, template and ``generate``."""

    def __init__(self, path: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                          dtype=torch.float32).eval()

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def greedy(self, prompt: list[int], count: int) -> tuple[list[int], str]:
        """The generated ids (an ending EOS left out) and their text as a continuation."""
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=count,
                                      do_sample=False)[0, len(prompt):].tolist()
        eos = self.model.generation_config.eos_token_id
        if out and out[-1] in (eos if isinstance(eos, list) else [eos]):
            out = out[:-1]
        return out, self.continuation(prompt, out)

    def continuation(self, prompt: list[int], generated: list[int]) -> str:
        decode = self.tokenizer.decode
        before = decode(prompt, skip_special_tokens=True)
        return decode(prompt + generated, skip_special_tokens=True)[len(before):]

    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """``log p(tokens[i] | tokens[:i])`` for i >= 1."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([tokens])).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def served(path: Path, test: Callable[[openai.AsyncOpenAI, httpx.AsyncClient],
                                      Awaitable[Any]], **options: Any) -> Any:
    """Run ``test`` against ``gpuflow serve path``, through the Python API; ``options``
    override the settings (the core runs in this process unless told)."""
    settings = gpuflow.ServeSettings(**{"source": str(path), "max_batch_size": 4,
                                        "kv_cache_gib": 0.02, "timeout_ms": 30000,
                                        "engine_process": False, **options})

    async def scenario() -> Any:
        async with serving(gpuflow.create_app(settings)) as client:
            api = openai.AsyncOpenAI(base_url=f"{client.base_url}/v1", api_key="none",
                                     max_retries=0)
            return await test(api, client)

    return asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_completions_and_chats_equal_transformers_generate(hub_models: Any,
                                                                  kind: str) -> None:
    """Both tokenizer kinds: completions and a chat, whole and streamed, are exactly
    transformers' greedy generation, its text decoded as a continuation (no broken
    characters, no lost or doubled spaces), with accents, CJK and emoji in prompts and
    answers. The long prompt passes Mistral's 32-token sliding window."""
    path = hub_models[kind]
    reference = Reference(path)
    prompts = [NON_ASCII_PROMPT, PROMPT * 3]
    expected = [reference.greedy(reference.tokenizer(p)["input_ids"], TOKENS) for p in prompts]
    chat_ids, chat_text = reference.greedy(reference.chat_ids(NON_ASCII_CHAT), TOKENS)
    assert len(reference.tokenizer(prompts[1])["input_ids"]) > 32
    assert not (expected[0][1] + chat_text).isascii()  # the answers are not ASCII either

    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        for prompt, (ids, text) in zip(prompts, expected, strict=True):
            done = await api.completions.create(model=str(path), prompt=prompt,
                                                max_tokens=TOKENS, temperature=0)
            assert done.choices[0].text == text
            assert done.usage.completion_tokens == len(ids)
            streamed = [c.choices[0].text async for c in await api.completions.create(
                model=str(path), prompt=prompt, max_tokens=TOKENS, temperature=0,
                stream=True)]
            assert "".join(streamed) == text
        chat = await api.chat.completions.create(model=str(path), messages=NON_ASCII_CHAT,
                                                 max_tokens=TOKENS, temperature=0)
        assert chat.choices[0].message.content == chat_text
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage.completion_tokens == len(chat_ids)
        assert chat.choices[0].finish_reason == ("length" if len(chat_ids) == TOKENS
                                                 else "stop")
        chunks = [c async for c in await api.chat.completions.create(
            model=str(path), messages=NON_ASCII_CHAT, max_tokens=TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True})]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
            == chat_text
        assert chunks[-1].usage.completion_tokens == len(chat_ids)
        assert chunks[-2].choices[0].finish_reason == chat.choices[0].finish_reason

    served(path, test)


def test_logprobs_echo_stops_and_seeds(hub_models: Any) -> None:
    """Logprobs are log_softmax of transformers' logits within 1e-4 (the prompt's too with
    echo); a stop string split over two tokens ends the text before it; n=3 with a seed
    gives three samples that repeat."""
    path = hub_models["llama"]
    reference = Reference(path)
    prompt_ids = reference.tokenizer(PROMPT)["input_ids"]
    generated, text = reference.greedy(prompt_ids, TOKENS)
    expected = reference.logprobs(prompt_ids + generated)
    pieces = [reference.continuation(prompt_ids, generated[:i])
              for i in range(len(generated) + 1)]
    # A stop made of the last character of one token's text and the first of the next's,
    # found nowhere earlier in the text.
    stop = next(stop for a, b in zip(pieces[1:], pieces[2:], strict=False)
                if len(b) > len(a) > 0
                and text.find(stop := a[-1] + b[len(a)]) == len(a) - 1)

    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        echoed = await api.completions.create(model=str(path), prompt=PROMPT, max_tokens=TOKENS,
                                              temperature=0, logprobs=3, echo=True)
        choice = echoed.choices[0]
        assert choice.text == PROMPT + text
        found = choice.logprobs.token_logprobs
        assert found[0] is None and len(found) == len(prompt_ids) + len(generated)
        assert torch.allclose(torch.tensor(found[1:]), expected, atol=1e-4)
        assert all(len(top) == 3 for top in choice.logprobs.top_logprobs[1:])
        chat = await api.chat.completions.create(model=str(path), messages=CHAT, max_tokens=8,
                                                 temperature=0, logprobs=True, top_logprobs=2)
        entries = chat.choices[0].logprobs.content
        assert len(entries) == chat.usage.completion_tokens
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
        assert math.isclose(entries[0].top_logprobs[0].logprob, entries[0].logprob)
        stopped = await api.completions.create(model=str(path), prompt=PROMPT, max_tokens=TOKENS,
                                               temperature=0, stop=[stop])
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == text[:text.index(stop)]
        samples = [await api.completions.create(model=str(path), prompt=PROMPT, max_tokens=12,
                                                temperature=1.0, n=3, seed=11)
                   for _ in range(2)]
        texts = [[c.text for c in sorted(s.choices, key=lambda c: c.index)] for s in samples]
        assert texts[0] == texts[1] and len(set(texts[0])) > 1
        assert samples[0].usage.prompt_tokens == len(prompt_ids)

    served(path, test)


def test_generation_ends_at_either_eos_id(hub_models: Any, tmp_path: Path) -> None:
    """generation_config.json's two EOS ids: the completion ends at whichever comes, with
    finish_reason "stop" and the EOS not in the text."""
    source = hub_models["llama"]
    reference = Reference(source)
    prompt_ids = reference.tokenizer(PROMPT)["input_ids"]
    generated, _ = reference.greedy(prompt_ids, 12)
    stop_at = generated.index(generated[5])

    async def test(api: openai.AsyncOpenAI, path: Path) -> None:
        done = await api.completions.create(model=str(path), prompt=PROMPT, max_tokens=12,
                                            temperature=0)
        assert done.choices[0].finish_reason == "stop"
        assert done.usage.completion_tokens == stop_at
        assert done.choices[0].text == reference.continuation(prompt_ids, generated[:stop_at])

    for position in (0, 1):  # the greedy 6th token as the first EOS id, then as the second
        path = Path(shutil.copytree(source, tmp_path / f"eos{position}"))
        config = json.loads((path / "generation_config.json").read_text())
        eos = list(config["eos_token_id"])
        eos[position] = generated[5]
        config["eos_token_id"] = eos
        (path / "generation_config.json").write_text(json.dumps(config))
        served(path, lambda api, _, path=path: test(api, path))


BAD_REQUESTS = [
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ("chat", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("chat", {"messages": CHAT, "n": 0}, "n"),
    ("chat", {"messages": CHAT, "max_tokens": 10_000}, "max_tokens"),
    ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"messages": CHAT, "stream": "yes"}, "stream"),
    ("chat", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools.0.function"),
    ("chat", {"messages": CHAT, "response_format": {"type": "yaml"}},
     "response_format.type"),
    ("chat", {"messages": [{"role": "user", "content": "x"},
                           {"role": "user", "content": "y"}]}, "messages"),
    ("completions", {"prompt": "x" * 2000}, "prompt"),
    ("completions", {"prompt": "x", "model": "another"}, "model"),
]


def test_bad_requests_name_the_param_and_the_server_stays_up(hub_models: Any) -> None:
    """Each refused with a 4xx in OpenAI's envelope naming the field (the Mistral template
    raises on two user turns in a row: its message is the answer's); a good request
    succeeds afterwards. NaN is sent raw, as Python's json writes it."""
    path = hub_models["mistral"]

    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        for route, body, param in BAD_REQUESTS:
            reply = await client.post(f"/v1/{route.replace('chat', 'chat/completions')}",
                                      json=body)
            error = reply.json()["error"]
            assert 400 <= reply.status_code < 500 and error["param"] == param, (body, error)
            assert set(error) == {"message", "type", "param", "code"}
        raw = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
        nan = await client.post("/v1/chat/completions", content=raw,
                                headers={"content-type": "application/json"})
        assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature"
        refused = (await client.post("/v1/chat/completions", json=BAD_REQUESTS[-3][1])).json()
        assert "roles must alternate" in refused["error"]["message"]
        ok = await api.chat.completions.create(model=str(path), messages=CHAT, max_tokens=4)
        assert ok.choices[0].finish_reason in ("stop", "length")

    served(path, test)


def test_a_model_without_a_chat_template_answers_chat_with_the_flag_to_give(
        hub_models: Any, tmp_path: Path) -> None:
    """GPT-2's directory has no template: chat is a 400 naming --chat-template, and the
    completion still works; given one with --chat-template, chat answers under the names
    of --served-model-name."""
    path = hub_models["gpt2"]
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                        "{% endfor %}assistant:")

    async def without(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        with pytest.raises(openai.BadRequestError, match="--chat-template"):
            await api.chat.completions.create(model=str(path), messages=CHAT)
        # Sampled from an untrained model, the first token may be its end-of-text id.
        done = await api.completions.create(model=str(path), prompt="for", max_tokens=3,
                                            extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3

    async def given(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        names = [m.id async for m in api.models.list()]
        assert names == ["tiny-gpt2", "gpt2"]
        chat = await api.chat.completions.create(model="gpt2", messages=CHAT, max_tokens=3)
        assert chat.model == "tiny-gpt2" and chat.usage.prompt_tokens > 5

    served(path, without)
    served(path, given, chat_template=str(template), served_model_name=("tiny-gpt2", "gpt2"))


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_qwen2_and_gpt2_complete_as_transformers_does(hub_models: Any, kind: str) -> None:
    path = hub_models[kind]
    reference = Reference(path)
    ids, text = reference.greedy(reference.tokenizer(PROMPT)["input_ids"], TOKENS)

    async def test(api: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
        done = await api.completions.create(model=str(path), prompt=PROMPT, max_tokens=TOKENS,
                                            temperature=0)
        assert done.choices[0].text == text and done.usage.completion_tokens == len(ids)

    served(path, test)


def test_the_command_line_serves_a_sharded_directory(hub_models: Any) -> None:
    """`gpuflow serve DIR` as a user types it, with the flags other servers spell the same
    way: the sharded Llama answers as transformers does, under its served name, within
    --max-model-len; /v1/predict takes token ids of any length and returns their logits."""
    path = hub_models["llama-sharded"]
    assert (path / "model.safetensors.index.json").is_file()
    reference = Reference(path)
    prompt = reference.tokenizer(PROMPT)["input_ids"]
    ids, text = reference.greedy(prompt, TOKENS)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "gpuflow.cli", "serve", str(path), "--port", str(port),
         "--served-model-name", "tiny-llama", "--max-model-len", "128", "--dtype", "float32",
         "--kv-cache-gib", "0.02", "--threads", "1", "--log-level", "warning"],
        env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        done = api.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=TOKENS,
                                      temperature=0)
        assert done.choices[0].text == text and done.model == "tiny-llama"
        with pytest.raises(openai.BadRequestError, match="context of 128 tokens"):
            api.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=120)
        logits = httpx.post(f"{url}/v1/predict", json={"inputs": {"input_ids": [prompt]}},
                            timeout=30).json()["predictions"][0]["outputs"]["logits"]
        with torch.inference_mode():
            expected = reference.model(torch.tensor([prompt])).logits[0]
        assert torch.allclose(torch.tensor(logits), expected, atol=1e-4)
        assert httpx.get(f"{url}/readyz").json()["generation"]["engine_core"] == \
            "a process of its own"
        the_engine_core_dies(server, url)
    finally:
        server.terminate()
        server.wait(timeout=30)


def the_engine_core_dies(server: subprocess.Popen[str], url: str) -> None:
    """The engine core's process killed under an open stream: the stream ends with an
    error event naming it, /readyz no longer answers 200, and the server exits non-zero
    saying why."""
    [core] = [pid for pid in map(int, Path(f"/proc/{server.pid}/task/{server.pid}/children")
                                 .read_text().split())
              if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
              and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    body = {"prompt": PROMPT, "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(core, signal.SIGKILL)
        events = [line for line in lines if line.startswith("data: ")]
    assert "engine core process" in events[-2] and "exited with code -9" in events[-2]
    assert events[-1] == "data: [DONE]"
    with contextlib.suppress(httpx.TransportError):
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 503
    assert server.wait(timeout=30) != 0
    assert server.stderr is not None and "exited with code -9" in server.stderr.read()
