"""`gpuflow train`'s flags are generated from the TrainConfig fields; docs/cli.md lists them."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from torch import nn
from torch.utils.data import TensorDataset

import gpuflow.workload
from gpuflow.cli import build_parser, main
from gpuflow.commands.plan import _build_workload
from gpuflow.config import TrainConfig
from gpuflow.flagdoc import COMMAND, between_markers, reference
from gpuflow.options import flags
from gpuflow.workload import Workload


def parse(*argv: str) -> dict:
    args = vars(build_parser().parse_args(["train", *argv]))
    return {k: v for k, v in args.items() if k not in ("command", "handler")}


def test_docs_flag_table_matches_the_fields() -> None:
    documented = between_markers((ROOT / "docs" / "cli.md").read_text())
    assert documented == reference(), (
        f"docs/cli.md's flag tables differ from the TrainConfig fields: run `{COMMAND}`")


def test_every_field_but_extra_is_a_flag_with_help() -> None:
    declared = {flag.name for flag in flags(TrainConfig)}
    assert declared == {f.name for f in dataclasses.fields(TrainConfig)} - {"extra"}
    assert all(flag.option.help for flag in flags(TrainConfig))


def test_help_shows_the_fields_defaults() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub.choices["train"]._actions}
    assert helps["batch_size"].endswith("(default: 64)")
    assert helps["lr"].endswith(f"(default: {TrainConfig.lr:g})")
    assert helps["pp_schedule"].endswith(f"(default: {TrainConfig.pp_schedule})")
    assert "(default: off)" in helps["clip_grad"]


def test_only_the_flags_given_are_set() -> None:
    assert parse() == {}
    assert parse("--lr", "1e-3", "--precision", "bf16") == {"lr": 1e-3, "precision": "bf16"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--batch-size", "auto"], {"batch_size": "auto"}),
        (["--batch-size", "12"], {"batch_size": 12}),
        (["--resume"], {"resume": True}),
        (["--resume", "runs/a"], {"resume": "runs/a"}),
        (["--no-checkpoints", "--no-progress"], {"save_checkpoints": False, "progress": False}),
        (["--compile", "--cuda-graphs"], {"compile": True, "cuda_graphs": True}),
        (["--no-reshard-after-forward"], {"reshard_after_forward": False}),
        (["--reshard-after-forward"], {"reshard_after_forward": True}),
        (["--clip-grad", "off"], {"clip_grad": None}),
        (["--clip-grad", "1.5"], {"clip_grad": 1.5}),
        (["--ema-decay", "off"], {"ema_decay": 0.0}),
        (["--ema-decay", "0.99"], {"ema_decay": 0.99}),
        (["--strategy", "auto", "--tp", "2"], {"strategy": "auto", "tp": 2}),
        (["--config", "run.toml"], {"config": "run.toml"}),
    ],
)
def test_special_flags_parse_as_before(argv: list[str], expected: dict) -> None:
    assert parse(*argv) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "x"], "argument --batch-size: invalid _int_or_auto value: 'x'"),
        (["--clip-grad", "x"], "argument --clip-grad: invalid _positive_or_none value: 'x'"),
        (["--tp", "2.5"], "argument --tp: invalid int value: '2.5'"),
        (["--lr", "x"], "argument --lr: invalid float value: 'x'"),
        (["--precision", "fp4"], "argument --precision: invalid choice: 'fp4'"),
    ],
)
def test_bad_flag_values_keep_argparse_messages(argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(*argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_layout_option_the_layout_ignores_exits_2_naming_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--strategy", "fsdp", "--nproc", "2", "--bucket-mb", "4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--bucket-mb 4 tunes DDP's gradient buckets" in err and "drop it" in err


def test_serve_refuses_cuda_graphs_without_a_cuda_device(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    code = main(["serve", str(tmp_path), "--device", "cpu", "--cuda-graphs"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--cuda-graphs captures CUDA graphs, and this server runs on cpu" in err


def test_serve_passes_the_generation_engine_flags_to_its_limits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import uvicorn

    from gpuflow.serve.generate.limits import EngineLimits
    from gpuflow.serve.settings import SETTINGS_ENV, settings_from_json

    (tmp_path / "config.json").write_text("{}")
    seen: list[str] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: seen.append(os.environ[SETTINGS_ENV]))
    monkeypatch.setenv(SETTINGS_ENV, "")  # serve sets it; put back as it was afterwards
    code = main(["serve", str(tmp_path), "--device", "cpu", "--max-batch-size", "8",
                 "--max-queue", "5", "--block-size", "8", "--no-prefix-cache",
                 "--max-num-batched-tokens", "512", "--ttft-timeout-ms", "250",
                 "--no-chunked-prefill"])
    assert code in (0, None)
    settings = settings_from_json(seen[0])
    assert settings.engine_limits() == EngineLimits(8, 5, None, 8, False, 512, False)
    assert settings.ttft_timeout_ms == 250 and settings.timeout_ms == 2000
    # CUDA graphs: by default for decode steps only (where the server is on CUDA), never
    # for /v1/predict unless asked; --no-cuda-graphs turns both off.
    assert settings.cuda_graphs is None and settings.decode_graphs
    assert not settings.engine_options().cuda_graphs and not settings.compile
    assert main(["serve", str(tmp_path), "--device", "cpu", "--no-cuda-graphs"]) in (0, None)
    assert not settings_from_json(seen[1]).decode_graphs
    # --max-autotune tunes the decode steps' compile; /v1/predict stays as it was.
    assert not settings.max_autotune
    assert main(["serve", str(tmp_path), "--device", "cpu", "--max-autotune"]) in (0, None)
    assert settings_from_json(seen[2]).max_autotune and not settings_from_json(seen[2]).compile
    assert main(["serve", str(tmp_path), "--block-size", "0"]) == 2


def test_plan_says_once_when_it_builds_the_model_for_real(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def build(spec: str, options: dict) -> Workload:
        model = nn.Linear(256, 256)  # 257 KiB of fp32 weights
        if model.weight.is_meta:
            raise RuntimeError("this factory reads its weights")
        return Workload("real", model, TensorDataset(torch.zeros(1, 256)))

    monkeypatch.setattr(gpuflow.workload, "resolve_workload", build)
    args = argparse.Namespace(workload="pkg:real", data=None, model_size=None, data_dir=None)
    with pytest.warns(UserWarning) as caught:
        workload = _build_workload(args)
    assert not workload.model.weight.is_meta
    assert [str(w.message) for w in caught] == [
        "Workload 'pkg:real' cannot be built on the meta device (RuntimeError: this factory "
        "reads its weights), so it was built for real: 0.25 MiB of weights allocated and "
        "initialised in this process's memory."]
