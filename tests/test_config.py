import dataclasses
import warnings
from pathlib import Path

import pytest

from gpuflow.config import TrainConfig, build_config, load_toml
from gpuflow.errors import UserError
from gpuflow.parallel.dims import ParallelDims


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


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"strategy": "fsdp", "nproc": 2, "bucket_mb": 4},
         r"--bucket-mb 4 tunes DDP's gradient buckets \(--strategy ddp\), which this run "
         r"\(--strategy fsdp\) does not have: drop it, or choose the layout it tunes"),
        ({"strategy": "tp", "nproc": 2, "bucket_mb": 4}, "--bucket-mb 4 tunes DDP's"),
        ({"strategy": "pp", "nproc": 2, "bucket_mb": 0.5}, "--bucket-mb 0.5 tunes DDP's"),
        ({"strategy": "ddp", "nproc": 2, "fsdp_prefetch": 2},
         r"--fsdp-prefetch 2 tunes FSDP's sharding \(--strategy fsdp\)"),
        ({"strategy": "tp", "nproc": 2, "fsdp_wrap": "model"}, "--fsdp-wrap model tunes FSDP"),
        ({"strategy": "single", "reshard_after_forward": False},
         "--no-reshard-after-forward tunes FSDP's sharding"),
        ({"nproc": 2, "fsdp_prefetch": 2}, r"this run \(--strategy ddp\)"),
        ({"strategy": "fsdp", "nproc": 2, "microbatches": 4},
         r"--microbatches 4 tunes the pipeline \(--strategy pp, or --strategy fsdp with --pp N\)"),
        ({"pp_schedule": "gpipe"}, r"--pp-schedule gpipe tunes the pipeline"),
        ({"strategy": "ddp", "nproc": 2, "pp_split": "manual", "bucket_mb": 4},
         "--pp-split manual tunes the pipeline"),
        ({"strategy": "ddp", "nproc": 2, "pp_split": "manual", "microbatches": 2},
         "--microbatches 2, --pp-split manual tune the pipeline .*: drop them, or choose "
         "the layout they tune"),
    ],
)
def test_a_layout_option_given_with_a_layout_it_does_not_tune_is_refused(
        values: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_config({}, values)


@pytest.mark.parametrize(("values", "warned"), [
    ({"strategy": "ddp", "nproc": 2, "bucket_mb": 4}, None),
    ({"strategy": "fsdp", "nproc": 2, "fsdp_prefetch": 2, "reshard_after_forward": False},
     None),
    ({"strategy": "fsdp", "nproc": 4, "pp": 2, "microbatches": 4, "fsdp_wrap": "model"}, None),
    ({"strategy": "pp", "nproc": 2, "pp_schedule": "gpipe", "pp_split": "manual"}, None),
    ({"strategy": "ddp", "nproc": 2, "fsdp_wrap": "block", "reshard_after_forward": True},
     None),
    # One process may be a rank of torchrun's ddp job: accepted, the run warns.
    ({"bucket_mb": 4}, r"--bucket-mb 4 tunes DDP's .*\(single dp1xtp1xpp1\) .*: ignored"),
    # The planner's choice (here: single): accepted, the run warns.
    ({"strategy": "auto", "fsdp_prefetch": 2},
     r"--fsdp-prefetch 2 tunes FSDP's .*\(single dp1xtp1xpp1\) .*: ignored"),
    # A resumed run's saved options: accepted, the run warns.
    ({"strategy": "fsdp", "nproc": 2, "bucket_mb": 4, "resume": "runs/a"},
     r"--bucket-mb 4 tunes DDP's .*\(fsdp dp2xtp1xpp1\) .*: ignored"),
])
def test_layout_options_the_layout_tunes_or_cannot_know_yet_pass(values: dict,
                                                                   warned: str | None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = build_config({}, values)
    if config.strategy == "auto":
        config = dataclasses.replace(config, strategy="single")
    world = config.nproc * config.nnodes
    if warned is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ParallelDims.from_config(config, world)
        return
    with pytest.warns(UserWarning, match=warned) as caught:
        ParallelDims.from_config(config, world)
    assert len(caught) == 1


def test_layout_options_the_chosen_layout_ignores_are_named_once() -> None:
    planned = dataclasses.replace(TrainConfig(strategy="auto", fsdp_prefetch=2,
                                              bucket_mb=4), strategy="ddp")
    with pytest.warns(UserWarning) as caught:
        ParallelDims.from_config(planned, 2)
    assert [str(w.message) for w in caught] == [
        "--fsdp-prefetch 2 tunes FSDP's sharding (--strategy fsdp), which this run "
        "(ddp dp2xtp1xpp1) does not have: ignored."]
