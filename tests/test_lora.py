"""LoRA adapters (--lora-rank): only the adapters train, sit in the optimizer and in the
checkpoint; a resumed run is bitwise the uninterrupted one; PEFT opens the exported adapter on
the base with the trained logits, and the merged export gives them too; a 16-bit base stays
16-bit; 2 DDP ranks and 2 FSDP ranks follow one process; --batch-size auto probes adapters;
bad input is refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hub_models import one_thread
from runs import losses, newest_weights

from gpuflow import TrainConfig, Trainer, train
from gpuflow.cli import main
from gpuflow.errors import EXIT_USER_ERROR
from gpuflow.export import export_model
from gpuflow.parallel.env import free_port
from gpuflow.workload import resolve_workload

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              # PeftModel.from_pretrained asks transformers a deprecated question.
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")]

SEQ = 32
STEPS = 3
# The adapter export is PEFT's own files over the same base: the logits PEFT computes equal
# the trained model's within fp32 rounding (docs/workloads/finetune.md states both bounds).
ADAPTER_ATOL = 1e-6
# Merged weights (W + s·BA) round differently from the adapters added beside W: measured
# 1.2e-5 on logits of magnitude up to 5.
MERGED_ATOL = 5e-5
# Ranks that split a batch follow one process of the whole batch (the full fine-tune's bound).
RANKS_ATOL = 1e-5


def setup(directory: Path, run_dir: Path, **options: Any) -> tuple[Any, TrainConfig]:
    """``hf:directory`` with rank-4 adapters on random ids for ``STEPS`` steps, seeded,
    its base loaded as the CLI loads it."""
    torch.manual_seed(0)
    settings = {"batch_size": 4, "lora_rank": 4, "max_steps": STEPS, **options}
    config = TrainConfig(workload=f"hf:{directory}", data="synthetic", seq_len=SEQ,
                         eval_every=0, log_every=1, progress=False, schedule="constant",
                         warmup_steps=0, lr=1e-2, run_dir=str(run_dir), **settings)
    workload = resolve_workload(f"hf:{directory}", {"data": "synthetic", "seq_len": SEQ},
                                frozen_precision=config.frozen_precision())
    return workload, config


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


@pytest.fixture(scope="module")
def lora_run(hub_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A trained LoRA run of the tiny Llama."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    with one_thread():  # as every test of the module trains
        return train(*setup(hub_models["llama"], run_dir))


def test_only_the_adapters_train_and_are_saved(lora_run: Any) -> None:
    model = lora_run.model
    trained = adapters(model)
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    assert all(param.dtype == torch.float32 for param in trained.values())
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    assert any(name.endswith("q_proj.base_layer.weight") for name in frozen)
    # Every linear layer but the LM head got adapters (all-linear).
    wrapped = {name.split(".lora_")[0].rpartition(".")[2] for name in trained}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"}
    assert set(newest_weights(lora_run.run_dir)) == set(trained)
    assert lora_run.summary["trainable_params"] == sum(p.numel() for p in trained.values())
    assert any(bool(p.abs().sum()) for name, p in trained.items() if ".lora_B." in name)


@pytest.mark.slow
def test_a_resumed_lora_run_is_bitwise_the_uninterrupted_one(hub_models: Any,
                                                             tmp_path: Path) -> None:
    """With dropout on the adapters: the resumed run draws the same masks."""
    directory = hub_models["llama"]
    full = train(*setup(directory, tmp_path / "full", lora_dropout=0.1))
    first = Trainer(*setup(directory, tmp_path / "split", lora_dropout=0.1))
    optimized = {id(p) for group in first.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in adapters(first.model).values()}
    first.run_steps(1)
    first.save_checkpoint()
    first.close()
    resumed = train(*setup(directory, tmp_path / "split", lora_dropout=0.1, resume=True))
    assert losses(tmp_path / "split")[-1] == losses(tmp_path / "full")[-1]
    for (name, a), b in zip(adapters(full.model).items(),
                            adapters(resumed.model).values(), strict=True):
        assert torch.equal(a, b), name


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_exports_open_in_peft_and_transformers_with_the_trained_logits(
        hub_models: Any, lora_run: Any, tmp_path: Path) -> None:
    import peft
    import transformers

    directory = hub_models["llama"]
    ids = torch.randint(0, 4096, (2, SEQ), generator=torch.Generator().manual_seed(1))
    trained = _logits(lora_run.model.eval(), ids)
    export_model(lora_run.run_dir, tmp_path / "adapter", "hf")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        path.name for path in (tmp_path / "adapter").iterdir()}
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8, "CAUSAL_LM")
    assert config["base_model_name_or_path"] == str(directory)
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    opened = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert (_logits(opened, ids) - trained).abs().max().item() <= ADAPTER_ATOL

    export_model(lora_run.run_dir, tmp_path / "merged", "hf", merge=True)
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "merged" / name).is_file(), name
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert (_logits(merged.eval(), ids) - trained).abs().max().item() <= MERGED_ATOL

    _, step = export_model(lora_run.run_dir, tmp_path / "merged.safetensors")
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "merged.safetensors")
    assert step == STEPS and set(weights) == set(merged.state_dict())


def test_textlm_adapters_on_named_modules_export_to_peft(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import peft

    from gpuflow.workloads import textlm

    def workload() -> Any:
        torch.manual_seed(0)
        return textlm.build(data="synthetic")

    config = TrainConfig(workload="textlm", data="synthetic", max_steps=2, batch_size=2,
                         eval_every=0, progress=False, lr=1e-2, warmup_steps=0,
                         run_dir=str(tmp_path / "run"), lora_rank=2, lora_targets="qkv")
    result = train(workload(), config)
    trained = adapters(result.model)
    assert trained and all(".attn.qkv.lora_" in name for name in trained)
    count = sum(p.numel() for p in trained.values())
    assert f"LoRA rank 2 on qkv ({count:,} parameters train, the base frozen)" in (
        capsys.readouterr().err)
    # The tied LM head (the embedding's weight under a second name) is frozen: not saved.
    assert set(newest_weights(tmp_path / "run")) == set(trained)
    export_model(tmp_path / "run", tmp_path / "adapter", "hf")
    opened = peft.PeftModel.from_pretrained(workload().model, tmp_path / "adapter").eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        worst = (opened(ids) - result.model.eval()(ids)).abs().max().item()
    assert worst <= ADAPTER_ATOL


def test_packed_conversations_train_adapters_and_leave_the_base_as_saved(
        hub_models: Any, tmp_path: Path) -> None:
    """Conversations, several to a window with the assistant-only loss, through adapters."""
    import transformers

    directory, chats = hub_models["llama"], tmp_path / "chats"
    chats.mkdir()
    lines = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                           {"role": "assistant", "content": f"{2 * i}."}]} for i in range(24)]
    (chats / "chats.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    torch.manual_seed(0)
    workload = resolve_workload(f"hf:{directory}", {"data_dir": str(chats), "seq_len": SEQ})
    config = TrainConfig(workload=f"hf:{directory}", data_dir=str(chats), seq_len=SEQ,
                         max_steps=2, batch_size=2, eval_every=0, progress=False,
                         run_dir=str(tmp_path / "run"), lora_rank=4)
    result = train(workload, config)
    saved = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    base = {name.replace("base_model.model.", "").replace(".base_layer", ""): param
            for name, param in result.model.named_parameters() if not param.requires_grad}
    assert base.keys() <= saved.keys() and len(base) == len(saved)
    assert all(torch.equal(param, saved[name]) for name, param in base.items())


def test_a_16_bit_base_loads_and_stays_16_bit_under_autocast(
        hub_models: Any, tmp_path: Path) -> None:
    """Loaded straight in bf16 (no fp32 copy of the base is made) where the run autocasts to
    bf16; in fp32 for a run that trains every weight or computes in another dtype."""
    import transformers

    source, directory = hub_models["llama"], tmp_path / "llama-bf16"
    shutil.copytree(source, directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    for precision, held in ((None, torch.float32), ("fp16", torch.float32),
                            ("fp32", torch.float32), ("bf16", torch.bfloat16)):
        loaded = resolve_workload(f"hf:{directory}", {"data": "synthetic"},
                                  frozen_precision=precision).model
        assert {param.dtype for param in loaded.parameters()} == {held}, precision
    workload, config = setup(directory, tmp_path / "run", max_steps=1, precision="bf16")
    assert {param.dtype for param in workload.model.parameters()} == {torch.bfloat16}
    result = train(workload, config)
    dtypes = {name: param.dtype for name, param in result.model.named_parameters()}
    assert {dtypes[name] for name in adapters(result.model)} == {torch.float32}
    assert {dtype for name, dtype in dtypes.items() if "lora_" not in name} == {torch.bfloat16}


def join_two_ranks(rank: int, port: int) -> None:
    """This spawned process as ``rank`` of 2 local ranks, on one thread."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def _ranks(rank: int, port: int, directory: str, run_dir: str) -> None:
    join_two_ranks(rank, port)
    from gpuflow.parallel.env import shutdown

    try:
        for strategy, steps in (("ddp", STEPS), ("fsdp", STEPS - 1), ("fsdp", STEPS)):
            # The second FSDP run resumes the first from its sharded adapters.
            train(*setup(Path(directory), Path(f"{run_dir}-{strategy}"), batch_size=2,
                         strategy=strategy, nproc=2, max_steps=steps,
                         resume=steps == STEPS and strategy == "fsdp"))
    finally:
        shutdown()


@pytest.mark.slow
def test_two_ddp_and_two_fsdp_ranks_train_adapters_as_one_process(
        hub_models: Any, lora_run: Any, tmp_path: Path) -> None:
    """FSDP's run is stopped and resumed on the way."""
    mp.spawn(_ranks, args=(free_port(), str(hub_models["llama"]), str(tmp_path / "run")),
             nprocs=2)
    one = losses(lora_run.run_dir)
    for strategy in ("ddp", "fsdp"):
        assert losses(tmp_path / f"run-{strategy}") == pytest.approx(one, abs=RANKS_ATOL)


# torch's MemTracker warns of the Llama's module hierarchy, for the full fine-tune too.
@pytest.mark.filterwarnings("ignore:The module hierarchy tracking:UserWarning")
def test_batch_size_auto_probes_adapters_without_the_bases_optimizer_state(
        hub_models: Any, tmp_path: Path) -> None:
    """The probe runs through a frozen base (an NF4 one here; torch refuses gradient hooks
    on frozen weights), and only the trained weights get optimizer state reserved: adapters
    fit more rows than the full fine-tune under the same cap."""
    largest = {}
    for name, options in (("full", {"lora_rank": None}), ("qlora", {"quantize_base": "nf4"})):
        trainer = Trainer(*setup(hub_models["llama"], tmp_path / name, batch_size="auto",
                                 memory_cap_gib=0.012, global_batch=8, max_steps=1,
                                 **options))
        largest[name] = trainer.batch_probe.largest_fitting
        trainer.close()
    assert largest["full"] < largest["qlora"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--lora-rank", "0"], "--lora-rank must be at least 1"),
    (["--lora-alpha", "8"], "--lora-alpha tunes LoRA adapters, which only --lora-rank"),
    (["--lora-rank", "4", "--strategy", "tp", "--nproc", "2"],
     "--lora-rank trains under --strategy single, ddp and fsdp"),
    (["--lora-rank", "4", "--lora-targets", "q_proj,nope"],
     "nope names no module of LlamaForCausalLM, where adapters attach to linear, embedding "
     "and convolution layers. Its linear layers are q_proj, k_proj"),
    (["--lora-rank", "4", "--lora-targets", "mlp"], "mlp names a LlamaMLP of LlamaForCausalLM"),
])
def test_bad_lora_flags_exit_2_naming_the_problem(
        hub_models: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        flags: list[str], message: str) -> None:
    code = main(["train", "--workload", f"hf:{hub_models['llama']}", "--data", "synthetic",
                 "--seq-len", str(SEQ), "--max-steps", "1", "--no-progress",
                 "--run-dir", str(tmp_path / "run"), *flags])
    assert code == EXIT_USER_ERROR
    assert message in capsys.readouterr().err


def test_merge_is_refused_for_a_run_without_adapters(tmp_path: Path) -> None:
    from gpuflow.errors import UserError
    from gpuflow.workloads import textlm

    config = TrainConfig(workload="textlm", data="synthetic", max_steps=1, batch_size=2,
                         eval_every=0, progress=False, run_dir=str(tmp_path / "run"))
    train(textlm.build(data="synthetic"), config)
    with pytest.raises(UserError, match="--merge merges LoRA adapters into their base"):
        export_model(tmp_path / "run", tmp_path / "out", "hf", merge=True)
