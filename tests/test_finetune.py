"""--workload hf:DIR: a Hugging Face model directory fine-tuned on text packed under its
tokenizer, one process and two FSDP ranks alike; textlm --tokenizer; the bad inputs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hub_models import write_corpus
from runs import losses, summary

from gpuflow import TrainConfig, train
from gpuflow.errors import UserError
from gpuflow.parallel.env import free_port
from gpuflow.workload import resolve_workload
from gpuflow.workloads.packing import pack

SEQ = 32
STEPS = 3


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, hub_models: Any) -> Path:
    root = tmp_path_factory.mktemp("finetune")
    write_corpus(root / "corpus")
    pack("textlm", root / "corpus", root / "packed", shard_mb=0.001, progress=False,
         tokenizer=hub_models["llama"], text_field="body", workers=0)
    return root / "packed"


def setup(directory: Path, packed: Path, run_dir: Path,
          **options: Any) -> tuple[Any, TrainConfig]:
    """``hf:directory`` on ``packed`` for ``STEPS`` steps, seeded."""
    torch.manual_seed(0)
    workload = resolve_workload(f"hf:{directory}", {"data_dir": str(packed), "seq_len": SEQ})
    config = TrainConfig(workload=f"hf:{directory}", data_dir=str(packed), seq_len=SEQ,
                         max_steps=STEPS, eval_every=0, log_every=1, progress=False,
                         schedule="constant", warmup_steps=0, lr=1e-3, run_dir=str(run_dir),
                         **options)
    return workload, config


def run(directory: Path, packed: Path, run_dir: Path, **options: Any) -> Any:
    return train(*setup(directory, packed, run_dir, **options))


def _fsdp_rank(rank: int, port: int, directory: str, packed: str, run_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from gpuflow.parallel.env import shutdown

    try:
        result = run(Path(directory), Path(packed), Path(run_dir), batch_size=2,
                     strategy="fsdp", nproc=2)
        layers = [type(layer).__name__ for layer in result.model.model.layers]
        Path(f"{run_dir}.layers.{rank}").write_text(json.dumps(layers))
    finally:
        shutdown()


def test_two_fsdp_ranks_train_hf_dir_as_one_process(hub_models: Any, packed: Path,
                                                    tmp_path: Path,
                                                    one_torch_thread: None) -> None:
    directory = hub_models["llama"]
    single = run(directory, packed, tmp_path / "single", batch_size=4)
    mp.spawn(_fsdp_rank, args=(free_port(), str(directory), str(packed),
                               str(tmp_path / "fsdp")), nprocs=2)
    one, two = losses(tmp_path / "single"), losses(tmp_path / "fsdp")
    assert len(one) == STEPS and one == pytest.approx(two, abs=1e-5)
    facts = summary(tmp_path / "fsdp")
    assert facts["strategy"] == "fsdp" and facts["world_size"] == 2
    # FSDP wrapped each of the model's decoder layers.
    layers = json.loads((tmp_path / "fsdp.layers.0").read_text())
    assert layers == ["FSDPLlamaDecoderLayer"] * 2
    # FLOPs (hence MFU) counted on the model's own shapes: 6 per weight of each matmul and
    # token, plus attention (a few percent at this size).
    linear = sum(m.weight.numel() for m in single.model.modules()
                 if isinstance(m, torch.nn.Linear))
    matmuls = 6 * linear * 4 * SEQ
    assert matmuls < summary(tmp_path / "single")["flops_per_step"] < 1.1 * matmuls


def test_the_export_is_a_model_directory_with_the_source_tokenizer(
        hub_models: Any, packed: Path, tmp_path: Path, one_torch_thread: None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpuflow.export import export_model

    directory = hub_models["llama"]
    result = run(directory, packed, tmp_path / "run", batch_size=2)
    export_model(tmp_path / "run", tmp_path / "out", format="hf")
    out = tmp_path / "out"
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (directory / name).read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|eot_id|>" and tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tokenizer.encode("Hello, who are you?")])
    with torch.no_grad():
        expected = result.model.eval()(ids).logits
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)


def test_textlm_takes_a_tokenizer_and_its_vocabulary(hub_models: Any, packed: Path,
                                                     tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from gpuflow.workloads import textlm

    workload = textlm.build(data_dir=str(packed), model_size="layers=1,dim=32,heads=2,seq=16",
                            tokenizer=str(hub_models["llama"]))
    assert workload.model.config.vocab_size == 4096
    x, y = workload.train_dataset[0]
    assert x.shape == (16,) and int(x.max()) < 4096
    words = tmp_path / "words"
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w1").save_pretrained(words)
    with pytest.raises(UserError, match="4096 ids .* more than the 100 rows"):
        textlm.build(data_dir=str(packed), model_size="layers=1,dim=32,heads=2,seq=16",
                     tokenizer=str(words))


def test_bad_directories_are_refused_with_the_fix(hub_models: Any, packed: Path,
                                                  tmp_path: Path) -> None:
    source = hub_models["llama"]
    bare = tmp_path / "no-weights"
    shutil.copytree(source, bare)
    (bare / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has no weights"):
        resolve_workload(f"hf:{bare}", {"data_dir": str(packed)})
    (bare / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="has no tokenizer"):
        resolve_workload(f"hf:{bare}", {"data_dir": str(packed), "from_config": True})
    small = tmp_path / "small-embedding"
    shutil.copytree(source, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    with pytest.raises(UserError, match="4096 ids, more than the 1000 rows"):
        resolve_workload(f"hf:{small}", {"data_dir": str(packed), "from_config": True})
    with pytest.raises(UserError, match="--seq-len 4096 is not between 1 and the context"):
        resolve_workload(f"hf:{source}", {"data_dir": str(packed), "seq_len": 4096})


def test_a_resumed_hf_dir_run_is_bitwise_the_uninterrupted_one(
        hub_models: Any, packed: Path, tmp_path: Path, one_torch_thread: None) -> None:
    from gpuflow import Trainer

    directory = hub_models["llama"]
    full = run(directory, packed, tmp_path / "full", batch_size=2, checkpoint_every=STEPS)
    first = Trainer(*setup(directory, packed, tmp_path / "split", batch_size=2,
                           checkpoint_every=STEPS))
    first.run_steps(1)
    first.save_checkpoint()
    first.close()
    resumed = run(directory, packed, tmp_path / "split", batch_size=2, checkpoint_every=STEPS,
                  resume=True)
    assert losses(tmp_path / "split")[-1] == losses(tmp_path / "full")[-1]
    for (name, a), b in zip(full.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_textlm_exports_declare_their_context_and_tokenizer(hub_models: Any,
                                                            tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from gpuflow.workloads import textlm

    size = "layers=1,dim=32,heads=2,seq=16"
    for name, tokenizer in (("bytes", None), ("llama", str(hub_models["llama"]))):
        workload = textlm.build(data="synthetic", model_size=size, tokenizer=tokenizer)
        workload.hf_writer()(workload.model, tmp_path / name)
    assert AutoTokenizer.from_pretrained(tmp_path / "bytes").model_max_length == 16
    exported = AutoTokenizer.from_pretrained(tmp_path / "llama")
    assert exported.eos_token == "<|eot_id|>" and exported.bos_token == "<|begin_of_text|>"
    assert (tmp_path / "llama" / "chat_template.jinja").is_file()
