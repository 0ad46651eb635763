"""`gpuflow predict`: one JSON line per input file, resumable, loader in worker processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from gpuflow import TrainConfig
from gpuflow.cli import main
from gpuflow.serve.engine import Engine, EngineOptions
from gpuflow.serve.predict import collect_inputs, finished_inputs
from gpuflow.serving import PredictRequest
from gpuflow.workloads import digits


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits model in the export format (weights + JSON config in the metadata)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("predict") / "digits.safetensors"
    save_file(digits.build().model.state_dict(), str(path), metadata={
        "config": json.dumps(TrainConfig(workload="digits").to_dict()), "step": "3"})
    return path


def write_images(folder: Path, count: int, start: int = 0) -> list[Path]:
    images, _ = digits.load_digits_tensors()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(start, start + count):
        path = folder / f"digit-{i:03d}.png"
        Image.fromarray((images[i, 0] * 255).round().numpy().astype(np.uint8)).save(path)
        paths.append(path)
    return paths


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_predict_writes_a_line_per_input_and_resumes(
        export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = tmp_path / "images"
    first = write_images(images, 5)
    request = tmp_path / "two.json"
    request.write_text(json.dumps({"inputs": torch.zeros(2, 1, 8, 8).tolist()}))
    (images / "notes.txt").write_text("not an image, and not picked from a folder")
    out = tmp_path / "preds.jsonl"

    assert main(["predict", str(export), str(images), str(request), "--out", str(out),
                 "--batch-size", "4", "--num-workers", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    lines = read_lines(out)
    assert sorted(line["input"] for line in lines) == sorted(map(str, [*first, request]))
    assert "files/s" in printed and "predicted 6 file(s) (7 rows)" in printed
    by_input = {line["input"]: line["predictions"] for line in lines}
    assert len(by_input[str(request)]) == 2

    engine = Engine.load(export, EngineOptions(device="cpu"))
    decoded = engine.codec.decode_file(first[0], {})
    expected = engine.codec.format(engine.run(decoded.key, decoded.rows)[0], PredictRequest())
    [served] = by_input[str(first[0])]
    assert served["index"] == expected["index"]
    assert served["probability"] == pytest.approx(expected["probability"], abs=1e-6)

    # An interrupted run: a torn last line, and more inputs arrived meanwhile.
    out.write_text(out.read_text() + '{"input": "torn')
    more = write_images(images, 2, start=5)
    assert main(["predict", str(export), str(images), str(request), "--out", str(out),
                 "--no-progress", "--num-workers", "0"]) == 0
    assert "skipped 6 already in" in capsys.readouterr().out
    lines = read_lines(out)
    assert len(lines) == 8
    assert {line["input"] for line in lines[6:]} == set(map(str, more))


def test_unreadable_inputs_get_an_error_line(
        export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    out = tmp_path / "preds.jsonl"
    assert main(["predict", str(export), str(broken), "--out", str(out), "--no-progress",
                 "--num-workers", "0"]) == 0
    [line] = read_lines(out)
    assert line["input"] == str(broken) and "not a readable PNG" in line["error"]
    assert "1 file(s) could not be read" in capsys.readouterr().out
    assert main(["predict", str(export), str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_collect_and_resume_helpers(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("a/1.png", "a/b/2.PNG", "a/b/3.wav"):
        (tmp_path / name).write_bytes(b"")
    found = collect_inputs([str(tmp_path / "a"), str(tmp_path / "a" / "1.png")], (".png",))
    assert found == [tmp_path / "a" / "1.png", tmp_path / "a" / "b" / "2.PNG"]
    out = tmp_path / "preds.jsonl"
    out.write_text('{"input": "x", "predictions": []}\n{"inp')
    assert finished_inputs(out) == {"x"}
    assert out.read_text().endswith("\n")


def test_predict_over_a_packed_set_gives_every_sample_with_its_target(
        export: Path, tmp_path: Path) -> None:
    packed, out = tmp_path / "packed", tmp_path / "packed.jsonl"
    assert main(["data", "pack", "--workload", "digits", "--out", str(packed),
                 "--no-progress"]) == 0
    assert main(["predict", str(export), str(packed), "--out", str(out), "--num-workers", "0",
                 "--no-progress"]) == 0
    lines = {line["input"]: line for line in read_lines(out)}
    train, val = digits.build().train_dataset, digits.build().val_dataset
    assert len(lines) == len(train) + len(val)
    engine = Engine.load(export, EngineOptions("cpu", "fp32", False))
    for split, dataset, index in (("train", train, 0), ("val", val, len(val) - 1)):
        line = lines[f"{packed}#{split}:{index}"]
        inputs, target = dataset[index]
        assert line["target"] == int(target)
        with torch.inference_mode():
            probs = torch.softmax(engine.loaded.model(inputs[None]), dim=-1)[0]
        [best] = line["predictions"]
        assert best["label"] == str(int(probs.argmax()))
        assert best["probability"] == pytest.approx(float(probs.max()), abs=1e-5)
