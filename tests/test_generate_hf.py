"""Hugging Face causal LMs in the generation engine: continuous batching over one slot cache
through transformers' cache API equals recomputing every prefix, for GPT-2 and Llama, and
serves /v1/completions for a Hugging Face workload gpuflow trained."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from conftest import serving
from generation import greedy, greedy_reference, greedy_text, through_engine
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from gpuflow.export import export_model
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.generate.engine import Done, GenerationEngine
from gpuflow.serve.generate.hf_models import HFCausalLM, SlotCache
from gpuflow.serve.generate.models import cached_lm, refusal
from gpuflow.serve.generate.sampling import SamplingParams

PROMPTS = [b"def f(x):", b"import torch", b"a", b"The quick brown fox jumps",
           b"class Engine:\n    ", b"0123456789", b"xy"]
BUDGETS = [12, 5, 20, 9, 14, 3, 17]


def gpt2(vocab_size: int = 256, attention: str = "sdpa") -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab_size,
                                       n_positions=128))
    model.set_attn_implementation(attention)
    return model.eval()


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).eval()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


MODELS = {"gpt2": gpt2, "llama": llama, "gpt2-eager": lambda: gpt2(attention="eager"),
          "gpt2-50257": lambda: gpt2(vocab_size=50257)}


def generate(lm: HFCausalLM, requests: list[tuple[bytes, SamplingParams]], slots: int,
             stagger: int = 0, bucketed: bool = False) -> list[tuple[list[int], Done]]:
    """Each request's generated tokens; the first ``stagger`` go in first, the rest once
    the engine runs, joining a running batch."""
    engine = GenerationEngine(lm, slots, 64, torch.inference_mode, bucketed=bucketed)
    return [(tokens, done) for _, tokens, done in through_engine(engine, requests, stagger)]


@pytest.mark.parametrize("name", list(MODELS))
def test_continuous_batching_equals_recomputing_every_prefix(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven prompts through three slots: sequences join as others leave (slots in use are
    not always consecutive), each decode step runs several sequences at their own
    positions, and every completion is the model's exact greedy one."""
    model = MODELS[name]()
    lm = cached_lm(model, torch.float32)
    assert isinstance(lm, HFCausalLM) and lm.context == 128 and lm.vocab_size == 256
    batches: list[tuple[int, bool]] = []
    at = SlotCache.at

    def recorded(self, slots, starts, length, span):
        batches.append((len(slots), len(set(starts.tolist())) > 1))
        return at(self, slots, starts, length, span)

    monkeypatch.setattr(SlotCache, "at", recorded)
    requests = greedy(PROMPTS, BUDGETS)
    results = generate(lm, requests, slots=3, stagger=4)
    for prompt, budget, (tokens, done) in zip(PROMPTS, BUDGETS, results, strict=True):
        assert tokens == greedy_reference(model, prompt, budget), prompt
        assert done.finish_reason == "length" and done.completion_tokens == budget
    assert any(size == 3 and mixed for size, mixed in batches)  # one step, many positions


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bucketed_decode_steps_equal_recomputing_every_prefix(name: str) -> None:
    """Decode steps padded to batch buckets 1,2,4,5 (the static-shape step that --compile
    compiles, over the whole context under a mask): padding rows write only the scratch
    slot, and every completion is still the exact greedy one."""
    model = MODELS[name]()
    lm = cached_lm(model, torch.float32)
    assert isinstance(lm, HFCausalLM)
    steps: list[list[int]] = []
    step = lm.step

    def recorded(tokens, cache, slots, starts):
        steps.append(slots.tolist())
        return step(tokens, cache, slots, starts)

    lm.step = recorded  # type: ignore[method-assign]
    requests = greedy(PROMPTS, BUDGETS)
    results = generate(lm, requests, slots=5, stagger=5, bucketed=True)
    for prompt, budget, (tokens, done) in zip(PROMPTS, BUDGETS, results, strict=True):
        assert tokens == greedy_reference(model, prompt, budget), prompt
        assert done.completion_tokens == budget
    assert {len(slots) for slots in steps} <= {1, 2, 4, 5}
    # 3 sequences and 1 padding row in the scratch slot (5): the bucket of 4.
    assert any(len(slots) == 4 and slots.count(5) == 1 for slots in steps)


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    lm = cached_lm(llama(), torch.float32)
    assert lm is not None
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    (alone, _), = generate(lm, [(b"x = ", params)], slots=1)
    others = [(p, SamplingParams(max_tokens=n, temperature=0.8, seed=i))
              for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS, strict=True))]
    batched = generate(lm, [*others[:3], (b"x = ", params), *others[3:]], slots=4, stagger=2)
    assert batched[3][0] == alone
    again = generate(lm, [(b"x = ", SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9,
                                                     seed=8))], slots=1)
    assert again[0][0] != alone


def test_a_vocabulary_that_is_not_bytes_and_models_that_are_not_lms_are_refused() -> None:
    small = gpt2(vocab_size=100)
    assert cached_lm(small, torch.float32) is None
    assert "vocabulary of 100 tokens is not bytes" in (refusal(small) or "")
    from transformers import ViTConfig, ViTForImageClassification

    vit = ViTForImageClassification(ViTConfig(image_size=8, patch_size=2, num_channels=1,
                                              hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32))
    assert "not a decoder-only causal language model" in (refusal(vit) or "")
    assert cached_lm(vit, torch.float32) is None


def test_the_cache_is_allocated_once_and_sized_by_the_model() -> None:
    lm = cached_lm(llama(), torch.bfloat16)
    assert lm is not None
    cache = lm.new_cache(5)
    # 2 layers x 2 key/value heads x 128 positions x (16 + 16) dims x 2 bytes, per slot.
    assert lm.bytes_per_slot() == 2 * 2 * 128 * 32 * 2
    assert cache.nbytes() == 5 * lm.bytes_per_slot()
    assert cache.keys.shape == (2, 5, 2, 128, 16) and cache.keys.dtype == torch.bfloat16


def test_a_trained_hf_workload_completes_through_the_server(
        hf_run: tuple[Path, torch.nn.Module]) -> None:
    """From its run dir and from its safetensors export: concurrent requests through fewer
    slots each get the trained model's greedy completion."""
    run_dir, model = hf_run
    expected = greedy_text(model, b"def main():", 12)
    exported, _ = export_model(run_dir, run_dir.parent / "gpt2.safetensors")

    async def scenario(source: Path) -> tuple[list[dict], httpx.Response, dict]:
        app = create_app(ServeSettings(str(source), device="cpu", max_batch_size=2))
        async with serving(app) as client:
            body = {"prompt": "def main():", "max_tokens": 12, "temperature": 0}
            replies = await asyncio.gather(*(client.post("/v1/completions", json=body)
                                             for _ in range(3)))
            too_long = await client.post("/v1/completions",
                                         json={"prompt": "y" * 30, "max_tokens": 4})
            ready = (await client.get("/readyz")).json()
        assert all(r.status_code == 200 for r in replies), replies[0].text
        return [r.json() for r in replies], too_long, ready

    for source in (run_dir, exported):
        answers, too_long, ready = asyncio.run(scenario(source))
        assert [a["choices"][0]["text"] for a in answers] == [expected] * 3
        assert answers[0]["usage"] == {"prompt_tokens": 11, "completion_tokens": 12,
                                       "total_tokens": 23}
        assert too_long.status_code == 400  # the workload's context is 32 tokens
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        assert ready["generation"]["slots"] == 2
