from pathlib import Path

import pytest

from gpuflow.config import TrainConfig, build_config, load_toml
from gpuflow.errors import UserError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_toml_sets_fields_and_flags_override(tmp_path: Path) -> None:
    values = load_toml(write(tmp_path, 'batch-size = 32\nprecision = "bf16"\nlr = 0.01\n'))
    config = build_config(values, {"lr": 0.5})
    assert (config.batch_size, config.precision, config.lr) == (32, "bf16", 0.5)
    assert config.grad_accum == TrainConfig().grad_accum


def test_unknown_toml_key_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="unknown keys: batchsize"):
        load_toml(write(tmp_path, "batchsize = 3\n"))


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not valid TOML"):
        load_toml(write(tmp_path, "lr = = 3\n"))
    with pytest.raises(UserError, match="does not exist"):
        load_toml(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"batch_size": 0}, "--batch-size must be at least 1"),
        ({"precision": "fp4"}, "--precision must be one of"),
        ({"lr": -1.0}, "--lr must be positive"),
        ({"max_steps": 10, "epochs": 1.0}, "either --max-steps or --epochs"),
        ({"batch_size": "64"}, "`batch_size` must be of type int"),
        ({"batch_size": True}, "`batch_size` must be of type int"),
        ({"checkpoint_every": -2}, "--checkpoint-every must be 0 or more"),
        ({"bucket_mb": 0}, "--bucket-mb must be positive"),
        ({"bucket_mb": "2"}, "`bucket_mb` must be of type float"),
        ({"fsdp_prefetch": 0}, "--fsdp-prefetch must be at least 1"),
        ({"fsdp_prefetch": 1.5}, "`fsdp_prefetch` must be of type int"),
    ],
)
def test_bad_values_are_rejected_with_the_flag_name(values: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_config({}, values)


def test_integers_are_accepted_where_floats_belong() -> None:
    config = build_config({"lr": 1, "epochs": 2, "bucket_mb": 4}, {})
    assert isinstance(config.lr, float) and config.epochs == 2.0
    assert isinstance(config.bucket_mb, float) and config.bucket_mb == 4.0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"grad_accum": True}, "`grad_accum` must be of type int"),
        ({"compile": 1}, "`compile` must be of type bool"),
        ({"precision": 5}, "`precision` must be of type str"),
        ({"epochs": "2"}, "`epochs` must be of type float"),
        ({"workload": 3}, "`workload` must be of type str"),
        ({"resume": 1}, "`resume` must be of type str or bool"),
        ({"extra": []}, "`extra` must be of type dict"),
        ({"strategy": "zero"}, "--strategy must be one of single, ddp, fsdp, tp, pp, auto"),
        ({"pp_split": "x"}, "--pp-split must be one of auto, trace, manual"),
    ],
)
def test_types_and_choices_come_from_the_annotations(values: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_config({}, values)


def test_values_of_the_annotated_types_pass() -> None:
    config = build_config({}, {"batch_size": "auto", "resume": "runs/a", "strategy": None,
                               "extra": {"k": 1}, "clip_grad": None})
    assert (config.batch_size, config.resume, config.extra) == ("auto", "runs/a", {"k": 1})
    assert build_config({}, {"resume": True}).resume is True
