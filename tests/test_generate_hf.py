"""Hugging Face causal LMs in the generation engine: continuous batching over the paged KV
pool (through transformers' cache API, or the Llama family's own forward) equals
recomputing every prefix, for GPT-2 and Llama, and serves /v1/completions for a Hugging
Face workload gpuflow trained."""

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
from gpuflow.serve.generate import fused
from gpuflow.serve.generate.build import build_engine
from gpuflow.serve.generate.hf_models import HFCausalLM
from gpuflow.serve.generate.limits import EngineLimits
from gpuflow.serve.generate.models import paged_lm, refusal
from gpuflow.serve.generate.requests import Done
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


def generate(lm: HFCausalLM, requests: list[tuple[bytes, SamplingParams]], seqs: int,
             stagger: int = 0, bucketed: bool = False,
             **limits: int | bool) -> list[tuple[list[int], Done]]:
    """Each request's generated tokens, ``seqs`` sequences at a time over a pool of 64
    blocks; the first ``stagger`` go in first, the rest once the engine runs, joining a
    running batch."""
    engine = build_engine(lm, 64, EngineLimits(seqs, 64, **limits),  # type: ignore[arg-type]
                          torch.inference_mode, bucketed)
    return [(tokens, done) for _, tokens, done in through_engine(engine, requests, stagger)]


@pytest.mark.parametrize("name", list(MODELS))
def test_continuous_batching_equals_recomputing_every_prefix(name: str) -> None:
    """Seven prompts, three sequences at a time, prompts in chunks of at most 16 tokens
    (blocks of 4) and shared blocks reused: sequences join as others leave, each step runs
    several sequences at their own positions, and every completion is the model's exact
    greedy one."""
    model = MODELS[name]()
    lm = paged_lm(model, torch.float32)
    assert isinstance(lm, HFCausalLM) and lm.context == 128 and lm.vocab_size == 256
    batches: list[tuple[int, bool]] = []
    forward = lm.forward

    def recorded(batch, pool):
        batches.append((batch.num_rows, len(set(batch.host_context_lens)) > 1))
        return forward(batch, pool)

    lm.forward = recorded  # type: ignore[method-assign]
    prompts = [PROMPTS[0] + p for p in PROMPTS]  # a shared prefix of two blocks
    requests = greedy(prompts, BUDGETS)
    results = generate(lm, requests, seqs=3, stagger=4, block_size=4,
                       max_num_batched_tokens=16)
    for prompt, budget, (tokens, done) in zip(prompts, BUDGETS, results, strict=True):
        assert tokens == greedy_reference(model, prompt, budget), prompt
        assert done.finish_reason == "length" and done.completion_tokens == budget
    assert any(size == 3 and mixed for size, mixed in batches)  # one step, many positions
    assert any(done.cached_tokens >= 8 for _, done in results)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="x86's oneDNN only")
def test_prepacked_products_equal_recomputing_every_prefix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 on the CPU with every weight prepacked for oneDNN (the tests' weights are under
    ``PREPACK_BYTES``, lowered here): steps of several rows take the packed products, steps
    of one MKL's, and every completion is still the model's exact greedy one."""
    monkeypatch.setattr(fused, "PREPACK_BYTES", 0)
    model = llama()
    lm = paged_lm(model, torch.float32)
    lm.prepack()  # type: ignore[union-attr]
    products = [p for layer in lm._layers for p in layer.products()]  # type: ignore[union-attr]
    assert products and all(p.packed is not None for p in products)
    results = generate(lm, greedy(PROMPTS, BUDGETS), seqs=3, stagger=4)  # type: ignore[arg-type]
    for prompt, budget, (tokens, _) in zip(PROMPTS, BUDGETS, results, strict=True):
        assert tokens == greedy_reference(model, prompt, budget), prompt


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bucketed_decode_steps_equal_recomputing_every_prefix(name: str) -> None:
    """Decode steps padded to batch buckets 1,2,4,5 (the static-shape step that --compile
    compiles, over the whole context under a mask): padding rows write only the null
    block, and every completion is still the exact greedy one."""
    model = MODELS[name]()
    lm = paged_lm(model, torch.float32)
    assert isinstance(lm, HFCausalLM)
    steps: list[list[int]] = []
    step = lm.decode_step

    def recorded(tokens, positions, slot_mapping, block_tables, pool):
        steps.append(slot_mapping.tolist())
        return step(tokens, positions, slot_mapping, block_tables, pool)

    lm.decode_step = recorded  # type: ignore[method-assign]
    requests = greedy(PROMPTS, BUDGETS)
    results = generate(lm, requests, seqs=5, stagger=5, bucketed=True)
    for prompt, budget, (tokens, done) in zip(PROMPTS, BUDGETS, results, strict=True):
        assert tokens == greedy_reference(model, prompt, budget), prompt
        assert done.completion_tokens == budget
    assert {len(slots) for slots in steps} <= {1, 2, 4, 5}
    # 3 sequences and 1 padding row in the null block: the bucket of 4.
    assert any(len(slots) == 4 and slots.count(0) == 1 for slots in steps)


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    lm = paged_lm(llama(), torch.float32)
    assert lm is not None
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    (alone, _), = generate(lm, [(b"x = ", params)], seqs=1)
    others = [(p, SamplingParams(max_tokens=n, temperature=0.8, seed=i))
              for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS, strict=True))]
    batched = generate(lm, [*others[:3], (b"x = ", params), *others[3:]], seqs=4, stagger=2)
    assert batched[3][0] == alone
    again = generate(lm, [(b"x = ", SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9,
                                                     seed=8))], seqs=1)
    assert again[0][0] != alone


def test_a_vocabulary_that_is_not_bytes_and_models_that_are_not_lms_are_refused() -> None:
    small = gpt2(vocab_size=100)
    assert paged_lm(small, torch.float32) is None
    assert "vocabulary of 100 tokens is not bytes" in (refusal(small) or "")
    from transformers import ViTConfig, ViTForImageClassification

    vit = ViTForImageClassification(ViTConfig(image_size=8, patch_size=2, num_channels=1,
                                              hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32))
    assert "not a decoder-only causal language model" in (refusal(vit) or "")
    assert paged_lm(vit, torch.float32) is None


def test_the_pool_is_allocated_once_and_sized_by_the_model() -> None:
    lm = paged_lm(llama(), torch.bfloat16)
    assert lm is not None
    pool = lm.new_pool(5, 16)
    # 2 layers x 2 key/value heads x 16 positions x (16 + 16) dims x 2 bytes, per block.
    assert lm.bytes_per_block(16) == 2 * 2 * 16 * 32 * 2
    assert pool.nbytes() == 5 * lm.bytes_per_block(16)
    assert pool.keys.numel() == 2 * 5 * 2 * 16 * 16 and pool.keys.dtype == torch.bfloat16


def test_a_trained_hf_workload_completes_through_the_server(
        hf_run: tuple[Path, torch.nn.Module]) -> None:
    """From its run dir and from its safetensors export: concurrent requests through fewer
    slots each get the trained model's greedy completion."""
    run_dir, model = hf_run
    expected = greedy_text(model, b"def main():", 12)
    exported, _ = export_model(run_dir, run_dir.parent / "gpt2.safetensors")

    async def scenario(source: Path) -> tuple[list[dict], httpx.Response, dict]:
        app = create_app(ServeSettings(str(source), device="cpu", max_batch_size=2,
                                       engine_process=False))
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
                                       "total_tokens": 23,
                                       "prompt_tokens_details": {"cached_tokens": 0}}
        assert too_long.status_code == 400  # the workload's context is 32 tokens
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        # Two whole contexts of 32 tokens in blocks of 16, and the null block.
        assert ready["generation"]["kv_blocks"] == 4
        assert ready["generation"]["max_num_seqs"] == 2
