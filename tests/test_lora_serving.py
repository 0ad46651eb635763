"""LoRA adapters served from one base: every request under its own adapter (or none) in the
same engine steps, each completion the exact greedy one of PEFT's model of that adapter
over the same base; adapters load into bounded slots on first use; cached prefixes never
cross from one adapter to another."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import api_error, run_cli, serving
from generation import greedy, greedy_reference, through_engine
from hub_models import PROMPTS as CLEAR_PROMPTS
from transformers import LlamaConfig, LlamaForCausalLM

from gpuflow.cli import main
from gpuflow.errors import EXIT_USER_ERROR, UserError
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.generate.adapter_files import AdapterRegistry, BaseLayout
from gpuflow.serve.generate.build import build_engine
from gpuflow.serve.generate.limits import EngineLimits
from gpuflow.serve.generate.models import adapter_refusal, paged_lm

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              # PeftModel.from_pretrained asks transformers a deprecated question.
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")]

PROMPTS = [b"def f(x):", b"import torch", b"a", b"The quick brown fox jumps",
           b"class Engine:\n    ", b"0123456789", b"xy", b"def f(x):"]
BUDGETS = [10, 6, 12, 8, 9, 4, 11, 7]
# Three adapters of other ranks, targets and scales: all projections; queries and values
# with a per-module alpha; the MLP under rsLoRA.
ADAPTERS = {
    "all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
               alpha_pattern={"v_proj": 4}),
    "mlp": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                use_rslora=True),
}


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).eval()


def adapter(base: LlamaForCausalLM, out: Path, seed: int, **config: object) -> torch.nn.Module:
    """A PEFT model of ``base`` with random (not zero) adapters, saved in ``out``."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base),
                                peft.LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(out)
    return model.eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[LlamaForCausalLM, dict[str, tuple[Path, torch.nn.Module]]]:
    base = llama()
    root = tmp_path_factory.mktemp("adapters")
    return base, {name: (root / name, adapter(base, root / name, seed, **config))
                  for seed, (name, config) in enumerate(ADAPTERS.items(), start=1)}


def test_a_step_mixing_the_base_and_three_adapters_equals_each_served_alone(
        adapters: tuple[LlamaForCausalLM, dict[str, tuple[Path, torch.nn.Module]]]) -> None:
    """Eight requests over the base and three adapters in two slots, four sequences at a
    time: steps mix rows of several adapters and the base, adapters take turns in the
    slots, and every completion is the exact greedy one of its own PEFT model."""
    base, made = adapters
    lm = paged_lm(base, torch.float32)
    assert lm is not None and adapter_refusal(base) is None
    engine = build_engine(lm, 64, EngineLimits(4, 64, block_size=4, max_num_batched_tokens=16,
                                               max_loras=2, max_lora_rank=8),
                          torch.inference_mode)
    engine.adapters = AdapterRegistry(BaseLayout.of(base), 8, frozenset({"base"}))
    ids = {name: engine.register_adapter(name, str(path)).id for name, (path, _) in made.items()}
    names = [None, "all", "qv", "mlp", "all", None, "mlp", "qv"]
    mixes: list[tuple[bool, int]] = []  # each step: base tokens in it, slots it used
    forward = lm.forward

    def recorded(batch, pool):  # type: ignore[no-untyped-def]
        slots: set[int] = set()
        for lora in batch.lora:
            mine = lora.kept.bool()
            slots |= set((lora.back[mine] // lora.length + lora.first).tolist())
        if batch.lora:
            adapted = sum(int(lora.kept.sum()) for lora in batch.lora)
            mixes.append((adapted < len(batch.tokens), len(slots)))
        return forward(batch, pool)

    lm.forward = recorded  # type: ignore[method-assign]
    results = through_engine(engine, greedy(PROMPTS, BUDGETS), 4,
                             [0 if name is None else ids[name] for name in names])
    for prompt, budget, name, result in zip(PROMPTS, BUDGETS, names, results, strict=True):
        model = base if name is None else made[name][1]
        assert result.tokens == greedy_reference(model, prompt, budget), (prompt, name)
    assert (True, 2) in mixes  # a step of the base and two adapters
    # The last prompt repeats the first: under another adapter its blocks are not reused.
    assert results[-1].done.cached_tokens == 0
    # Three adapters read into two slots: one at least took a slot another had held.
    assert engine.core.adapters.table is not None and engine.core.adapters.table.loads >= 3


def test_bucketed_decode_steps_carry_each_rows_adapter(
        adapters: tuple[LlamaForCausalLM, dict[str, tuple[Path, torch.nn.Module]]]) -> None:
    """The static-shape decode step (what --compile compiles) reads each row's slot, the
    padding rows the base's."""
    base, made = adapters
    lm = paged_lm(base, torch.float32)
    assert lm is not None
    engine = build_engine(lm, 64, EngineLimits(3, 64, max_loras=3, max_lora_rank=8),
                          torch.inference_mode, bucketed=True)
    engine.adapters = AdapterRegistry(BaseLayout.of(base), 8, frozenset())
    ids = [engine.register_adapter(name, str(path)).id for name, (path, _) in made.items()]
    results = through_engine(engine, greedy(PROMPTS[:3], BUDGETS[:3]), 3, ids)
    for prompt, budget, (_, model), result in zip(PROMPTS, BUDGETS, made.values(), results,
                                                  strict=False):
        assert result.tokens == greedy_reference(model, prompt, budget), prompt


def test_adapters_that_do_not_fit_the_base_are_refused(
        adapters: tuple[LlamaForCausalLM, dict[str, tuple[Path, torch.nn.Module]]],
        tmp_path: Path) -> None:
    """A rank past the limit, another base's shapes or name, DoRA, a module outside the
    decoder layers' projections, a name in use: each refused, naming the problem."""
    base, made = adapters
    registry = AdapterRegistry(BaseLayout.of(base, "tiny-llama"), 4, frozenset({"base"}))
    with pytest.raises(UserError, match="rank 8, past --max-lora-rank 4"):
        registry.add("qv", str(made["qv"][0]))
    with pytest.raises(UserError, match="taken"):
        registry.add("base", str(made["all"][0]))
    registry.add("all", str(made["all"][0]))
    with pytest.raises(UserError, match="taken"):
        registry.add("all", str(made["mlp"][0]))

    wider = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    adapter(wider, tmp_path / "wider", 0, r=4, target_modules=["q_proj"])
    with pytest.raises(UserError, match="does not fit this base.*trained on another model"):
        registry.add("wider", str(tmp_path / "wider"))

    adapter(base, tmp_path / "head", 0, r=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(UserError, match="lm_head.*does not adapt"):
        registry.add("head", str(tmp_path / "head"))

    config_path = tmp_path / "renamed" / "adapter_config.json"
    adapter(base, tmp_path / "renamed", 0, r=4, target_modules=["q_proj"])
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "base_model_name_or_path": "org/other"}))
    with pytest.raises(UserError, match="trained on 'org/other'.*tiny-llama"):
        registry.add("renamed", str(tmp_path / "renamed"))
    config_path.write_text(json.dumps({**config, "base_model_name_or_path": "/x/tiny-llama",
                                       "use_dora": True}))
    with pytest.raises(UserError, match="DoRA"):
        registry.add("dora", str(tmp_path / "renamed"))
    with pytest.raises(UserError, match="not a LoRA adapter directory"):
        registry.add("nothing", str(tmp_path))


def test_models_outside_the_llama_family_refuse_adapters() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256))
    assert "Llama, Mistral and Qwen2" in (adapter_refusal(gpt2) or "")


@pytest.fixture(scope="module")
def exported(hub_models: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A LoRA run of the tiny hub Llama, exported as PEFT's adapter and merged: trained
    long and scaled enough (alpha 16 x rank) to change its greedy text."""
    from test_lora import setup

    from gpuflow import train
    from gpuflow.export import export_model

    root = tmp_path_factory.mktemp("lora-export")
    run = train(*setup(hub_models["llama"], root / "run", max_steps=12, lora_alpha=64))
    export_model(run.run_dir, root / "adapter", "hf")
    export_model(run.run_dir, root / "merged", "hf", merge=True)
    return root / "adapter", root / "merged"


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], count: int) -> str:
    """The greedy text of transformers' forward on ``base`` (with PEFT's adapter) over the
    whole prefix at every token, end-of-sequence ids taken as any other."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            tokens.append(int(model.eval()(torch.tensor([tokens])).logits[0, -1].argmax()))
    return AutoTokenizer.from_pretrained(base).decode(tokens[len(prompt):],
                                                      skip_special_tokens=True)


async def completed(client: httpx.AsyncClient, model: str, prompt: list[int]) -> str:
    reply = await client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model
    return reply.json()["choices"][0]["text"]


def test_a_trained_adapter_served_by_name_equals_its_merge_and_peft(
        hub_models: Any, exported: tuple[Path, Path]) -> None:
    """`gpuflow serve DIR --lora tuned=ADAPTER` (the core in its own process): the adapter
    answers as its merged export served alone and as PEFT over transformers do, the base
    as the base does; /v1/models lists both; adapters load and unload at run time."""
    from transformers import AutoTokenizer

    base, (adapter, merged) = hub_models["llama"], exported
    prompt = AutoTokenizer.from_pretrained(base)(CLEAR_PROMPTS[0])["input_ids"]

    async def scenario() -> dict[str, str]:
        texts = {}
        app = create_app(ServeSettings(str(base), device="cpu", max_batch_size=4,
                                       lora=(("tuned", str(adapter)),), max_loras=1,
                                       served_model_name=("tiny",)))
        async with serving(app) as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m.get("parent")) for m in listed] == [("tiny", None),
                                                                   ("tuned", "tiny")]
            texts["tuned"], texts["tiny"] = await asyncio.gather(
                completed(client, "tuned", prompt), completed(client, "tiny", prompt))
            assert api_error(await client.post("/v1/completions", json={
                "model": "other", "prompt": "x"}), 404)["code"] == "model_not_found"
            texts["again"] = await runtime_adapter(client, adapter, prompt)
        async with serving(create_app(ServeSettings(str(merged), device="cpu",
                                                    served_model_name=("merged",),
                                                    engine_process=False))) as client:
            texts["merged"] = await completed(client, "merged", prompt)
        return texts

    texts = asyncio.run(scenario())
    assert texts["tuned"] == texts["merged"] == texts["again"] == peft_greedy(
        base, adapter, prompt, 8)
    assert texts["tiny"] == peft_greedy(base, None, prompt, 8) != texts["tuned"]


async def runtime_adapter(client: httpx.AsyncClient, adapter: Path, prompt: list[int]) -> str:
    """Load ``adapter`` as a second name, complete under it, unload it; bad loads refused."""
    load = "/v1/load_lora_adapter"
    assert api_error(await client.post(load, json={"lora_name": "tuned",
                                                   "lora_path": str(adapter)}),
                     400)["param"] == "lora_name"
    assert api_error(await client.post(load, json={"lora_name": "x", "lora_path": "/nowhere"}),
                     400)["param"] == "lora_path"
    reply = await client.post(load, json={"lora_name": "again", "lora_path": str(adapter)})
    assert reply.status_code == 200, reply.text
    text = await completed(client, "again", prompt)
    unload = "/v1/unload_lora_adapter"
    assert (await client.post(unload, json={"lora_name": "again"})).status_code == 200
    assert api_error(await client.post(unload, json={"lora_name": "again"}), 404)
    assert api_error(await client.post("/v1/completions", json={
        "model": "again", "prompt": prompt}), 404)["code"] == "model_not_found"
    return text


@pytest.mark.parametrize(("flags", "message"), [
    (["--lora", "tuned"], "give NAME=ADAPTER_DIR"),
    (["--lora", "a=/nowhere"], "is not a directory"),
    (["--lora", "a={adapter}", "a={adapter}"], "names 'a' twice"),
    (["--lora", "a={adapter}", "--max-loras", "0"], "--max-loras 0 leaves them no slot"),
])
def test_bad_lora_flags_exit_2_naming_the_problem(
        exported: tuple[Path, Path], capsys: pytest.CaptureFixture[str], flags: list[str],
        message: str) -> None:
    flags = [flag.format(adapter=exported[0]) for flag in flags]
    assert main(["serve", "/nowhere", "--device", "cpu", *flags]) == EXIT_USER_ERROR
    assert message in capsys.readouterr().err


def test_an_adapter_that_does_not_fit_stops_the_server_with_exit_2(
        hub_models: Any, exported: tuple[Path, Path]) -> None:
    """Checked once the model loads, before the server is ever ready."""
    result = run_cli("serve", str(hub_models["llama"]), "--device", "cpu", "--port", "0",
                     "--lora", f"a={exported[0]}", "--max-lora-rank", "2", timeout=120)
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    assert "rank 4, past --max-lora-rank 2: serve with --max-lora-rank 4" in result.stderr


def test_a_cached_prefix_is_reused_under_its_own_adapter_alone(
        adapters: tuple[LlamaForCausalLM, dict[str, tuple[Path, torch.nn.Module]]]) -> None:
    """One prompt four times, one after another: under adapter 1 (computed), adapter 1
    again (its blocks reused), adapter 2 and the base (computed afresh each)."""
    from gpuflow.serve.generate.adapter_files import AdapterRef
    from gpuflow.serve.generate.build import build_core
    from gpuflow.serve.generate.messages import Inbox, NewRequest
    from gpuflow.serve.generate.sampling import SamplingParams

    base, made = adapters
    lm = paged_lm(base, torch.float32)
    assert lm is not None
    core = build_core(lm, 32, EngineLimits(2, 64, block_size=4, max_loras=2, max_lora_rank=8))
    refs = tuple(AdapterRef(i, name, str(made[name][0])) for i, name in ((1, "all"), (2, "qv")))
    core.receive(Inbox(adapters=refs))
    cached = []
    with torch.inference_mode():
        for request, adapter in enumerate((1, 1, 2, 0)):
            core.receive(Inbox((NewRequest(request, list(b"def f(x): return"),
                                           SamplingParams(max_tokens=2, temperature=0.0),
                                           adapter),)))
            outputs = []
            while not core.idle:
                report = core.step()
                outputs += [] if report is None else report.outputs
            cached.append(next(o.cached_tokens for o in outputs if o.id == request))
    core.stop()
    assert cached == [0, 12, 0, 0]  # 16 prompt tokens: three whole blocks short of the last


def test_a_request_waits_for_a_slot_and_fails_if_its_adapter_is_unloaded_meanwhile(
        adapters: tuple[LlamaForCausalLM, dict[str, tuple[Path, torch.nn.Module]]]) -> None:
    """One slot: a request under a second adapter waits (counted as waiting) while the
    first runs; unloaded meanwhile, it fails saying so; a third, under the first adapter's
    slot once free, runs."""
    from gpuflow.serve.generate.adapter_files import AdapterRef
    from gpuflow.serve.generate.build import build_core
    from gpuflow.serve.generate.messages import Inbox, NewRequest
    from gpuflow.serve.generate.sampling import SamplingParams

    base, made = adapters
    lm = paged_lm(base, torch.float32)
    assert lm is not None
    core = build_core(lm, 32, EngineLimits(4, 64, max_loras=1, max_lora_rank=8))
    refs = tuple(AdapterRef(i, name, str(made[name][0])) for i, name in ((1, "all"), (2, "qv")))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    core.receive(Inbox((NewRequest(0, [1, 2, 3], params, 1), NewRequest(1, [4, 5], params, 2)),
                       adapters=refs))
    finished: dict[int, tuple[str | None, str | None]] = {}
    with torch.inference_mode():
        report = core.step()
        assert report is not None and report.occupancy.waiting == 1  # no slot for "qv"
        core.receive(Inbox((NewRequest(2, [6, 7], params, 1),), unregistered=(2,)))
        while not core.idle:
            report = core.step()
            for output in () if report is None else report.outputs:
                if output.finish is not None:
                    finished[output.id] = (output.finish, output.error)
    core.stop()
    assert finished[0] == ("length", None) and finished[2] == ("length", None)
    assert finished[1] == ("failed", "its LoRA adapter was unloaded")
