"""`gpuflow report` and the bottleneck diagnosis: rules on synthetic runs, the HTML page, a
real browser rendering it, and the GPU benchmark script's syntax and CPU dry run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from gpuflow.cli import main as gpuflow_main
from gpuflow.errors import UserError
from gpuflow.report import diagnose as dx
from gpuflow.report.html import render_report
from gpuflow.report.runs import load_run
from gpuflow.telemetry.steps import medians

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

CPU = {"device": "cpu", "device_name": "Test CPU", "peak_mem_kind": "process_peak_rss",
       "peak_flops": 1e12, "peak_flops_source": "measured: test"}
H100 = {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3",
        "peak_mem_kind": "cuda_max_allocated", "peak_flops": 989e12,
        "peak_flops_source": "NVIDIA H100 datasheet"}


def report_cli(*args: str) -> tuple[int, str, str]:
    """`gpuflow report ARGS` in this process (a subprocess would import torch again)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = gpuflow_main(["report", *args])
    return code, out.getvalue(), err.getvalue()


def write_run(path: Path, regions_ms: dict[str, float | None], mfu: float | None = 0.5,
              peak_mem: int = 2**30, summary: bool = True, steps: int = 6,
              **facts: Any) -> Path:
    """A run dir whose every window spends ``regions_ms`` per step (with a little jitter)."""
    path.mkdir(parents=True)
    config = {"batch_size": 32, "num_workers": 0, "grad_accum": 1, "compile": False,
              "activation_checkpointing": False, "data": "real",
              **facts.pop("config", {})}
    records = []
    for index in range(steps):
        regions = {key: None if ms is None else ms * (1 + 0.01 * index) / 1e3
                   for key, ms in regions_ms.items()}
        step_time = sum(v for v in regions.values() if v is not None)
        records.append({
            "step": 10 * (index + 1), "loss": 2.0 / (index + 1), "samples_per_s": 32 / step_time,
            "tokens_per_s": None, "step_time_s": step_time, **regions,
            "data_wait_frac": regions["data_wait_s"] / step_time,
            "comm_frac": None if regions["comm_s"] is None else regions["comm_s"] / step_time,
            "achieved_flops": None if mfu is None else mfu * 1e12, "mfu": mfu,
            "peak_mem_bytes": peak_mem, "world_size": facts.get("world_size", 1),
        })
    lines = [json.dumps(r) for r in records]
    lines.insert(3, json.dumps({"event": "eval", "step": 30, "val_loss": 0.9}))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "config.json").write_text(json.dumps(config))
    if summary:
        base = {"workload": "synthetic", "steps": records[-1]["step"], "precision": "fp32",
                "strategy": "single", "world_size": 1, "compiled": False,
                "activation_checkpointing": False, "global_batch": 32,
                "versions": {"torch": "test"}, **CPU}
        (path / "summary.json").write_text(json.dumps({
            **base, **facts, "median": medians(records), "peak_mem_bytes": peak_mem,
            "final_metrics": {"val_loss": 0.9}, "config": config}))
    return path


def regions(data: float = 1.0, compute: float = 20.0, comm: float | None = 0.0,
            optimizer: float = 2.0, host: float = 0.5) -> dict[str, float | None]:
    return {"data_wait_s": data, "compute_s": compute, "comm_s": comm,
            "optimizer_s": optimizer, "host_s": host}


# (name, regions, run facts, expected bottleneck, fragments of the suggestions)
CASES = [
    ("input", regions(data=12.0), {}, dx.INPUT, ["--num-workers 2 (now 0)", "--data synthetic"]),
    ("host", regions(host=9.0, compute=10.0), {**H100}, dx.HOST,
     ["--compile", "CUDA graphs", "--batch-size 64"]),
    # 2.1 M parameters: 8 MiB of fp32 gradients, mostly in PyTorch's second, 25 MiB bucket.
    ("comm-ddp", regions(comm=8.0),
     {"strategy": "ddp", "world_size": 2, "trainable_params": 2_100_000}, dx.COMM,
     ["--grad-accum 2", "--bucket-mb 1 (now PyTorch's 25)", "8.01 MiB of gradients"]),
    ("comm-ddp-many-buckets", regions(comm=8.0),
     {"strategy": "ddp", "world_size": 2, "trainable_params": 124_000_000,
      "config": {"bucket_mb": 10.0}}, dx.COMM,
     ["--bucket-mb 5 (now 10)", "--bucket-mb 20 instead"]),
    ("comm-fsdp-cpu", regions(comm=8.0), {"strategy": "fsdp", "world_size": 2}, dx.COMM,
     ["--no-reshard-after-forward", "--fsdp-wrap model", "--strategy ddp",
      "--precision bf16"]),
    ("comm-fsdp-model-cpu", regions(comm=8.0),
     {"strategy": "fsdp", "world_size": 2, "config": {"fsdp_wrap": "model"}}, dx.COMM,
     ["--strategy ddp", "--precision bf16"]),
    ("comm-fsdp-model-cuda", regions(comm=8.0),
     {**H100, "strategy": "fsdp", "world_size": 2, "config": {"fsdp_wrap": "model"}},
     dx.COMM, ["--fsdp-wrap block"]),
    ("comm-fsdp-cuda", regions(comm=8.0), {**H100, "strategy": "fsdp", "world_size": 2},
     dx.COMM, ["--no-reshard-after-forward", "--fsdp-prefetch 2 (now FSDP's own: 1",
               "--precision bf16"]),
    ("comm-fsdp-prefetched-cuda", regions(comm=8.0),
     {**H100, "strategy": "fsdp", "world_size": 2, "config": {"fsdp_prefetch": 2}},
     dx.COMM, ["--fsdp-prefetch 3 (now 2)"]),
    ("comm-tp", regions(comm=8.0), {"strategy": "tp", "world_size": 2,
                                    "mesh": {"dp": 1, "tp": 2, "pp": 1}},
     dx.COMM, ["--strategy fsdp (or ddp) without --tp"]),
    ("comm-fsdp-tp", regions(comm=8.0), {"strategy": "fsdp", "world_size": 8,
                                         "mesh": {"dp": 2, "tp": 4, "pp": 1}},
     dx.COMM, ["--grad-accum 2", "--tp 2", "--no-reshard-after-forward"]),
    ("comm-pp", regions(comm=8.0), {"strategy": "pp", "world_size": 2,
                                    "mesh": {"dp": 1, "tp": 1, "pp": 2},
                                    "config": {"microbatches": 4}},
     dx.COMM, ["--microbatches 8 (now 4)", "20% now, 11% then", "interleaved-1f1b",
               "no --pp"]),
    ("memory", regions(), {**H100, "peak_mem_bytes": 76 * 2**30, "world_size": 2,
                           "strategy": "ddp"}, dx.MEMORY,
     ["--activation-checkpointing", "--precision bf16", "--strategy fsdp"]),
    ("low-mfu", regions(), {"mfu": 0.12}, dx.LOW_MFU_COMPUTE,
     ["--precision bf16", "--compile", "--batch-size 64, now 32"]),
]


@pytest.mark.parametrize(("name", "times", "facts", "bottleneck", "fragments"), CASES,
                         ids=[case[0] for case in CASES])
def test_each_bottleneck_is_named_with_evidence_and_flags(
        tmp_path: Path, name: str, times: dict[str, float | None], facts: dict[str, Any],
        bottleneck: str, fragments: list[str]) -> None:
    facts = dict(facts)
    mfu = facts.pop("mfu", 0.55)
    peak_mem = facts.pop("peak_mem_bytes", 2**30)
    run = load_run(write_run(tmp_path / name, times, mfu=mfu, peak_mem=peak_mem, **facts))
    diagnosis = dx.diagnose(run.facts)
    top = diagnosis.top
    assert top is not None and top.bottleneck == bottleneck, diagnosis
    assert re.search(r"\d+%", top.evidence), top.evidence
    for fragment in fragments:
        assert any(fragment in s for s in top.suggestions), (fragment, top.suggestions)
    lines = dx.headline(diagnosis, run.median)
    assert lines[0].startswith(f"bottleneck: {bottleneck}: ")
    assert len(lines) == 1 + len(top.suggestions)


def test_fsdp_as_one_unit_is_not_told_to_keep_blocks_gathered(tmp_path: Path) -> None:
    """The whole model is one unit, which is never resharded after forward: the per-block
    remedies do not apply to it, on the CPU or on a GPU."""
    for device, facts in (("cpu", {}), ("cuda", H100)):
        run = load_run(write_run(tmp_path / device, regions(comm=8.0), strategy="fsdp",
                                 world_size=2, config={"fsdp_wrap": "model"}, **facts))
        suggestions = " ".join(dx.diagnose(run.facts).top.suggestions)
        assert "--no-reshard-after-forward" not in suggestions
        assert "--fsdp-wrap model" not in suggestions
        assert "--fsdp-prefetch" not in suggestions


def test_pipelined_runs_are_not_told_to_compile(tmp_path: Path) -> None:
    """gpuflow does not compile pipeline stages (--compile with --pp is refused)."""
    run = load_run(write_run(tmp_path / "run", regions(host=4.0, compute=10.0), mfu=0.1,
                             **H100, strategy="pp", world_size=2,
                             mesh={"dp": 1, "tp": 1, "pp": 2}))
    findings = dx.diagnose(run.facts).findings
    assert {f.bottleneck for f in findings} >= {dx.HOST, dx.LOW_MFU_COMPUTE}
    suggestions = " ".join(s for f in findings for s in f.suggestions)
    assert "--compile" not in suggestions and "CUDA graphs" not in suggestions


def test_input_bound_figure_is_the_measured_share(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", regions(data=12.0, compute=20.0, optimizer=2.0,
                                                        host=0.5, comm=0.0)))
    top = dx.diagnose(run.facts).top
    assert top is not None
    assert "data wait is 35% of the step" in top.evidence  # 12 of 34.5 ms
    assert top.severity == pytest.approx(12.0 / 34.5, rel=1e-6)


def test_several_findings_rank_by_share_of_the_step(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", regions(data=5.0, host=15.0, compute=20.0)))
    names = [f.bottleneck for f in dx.diagnose(run.facts).findings]
    assert names[:2] == [dx.HOST, dx.INPUT]


def test_healthy_run_has_no_bottleneck(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", regions(), mfu=0.55, **H100))
    diagnosis = dx.diagnose(run.facts)
    assert diagnosis.findings == ()
    assert dx.headline(diagnosis, run.median) == [
        "bottleneck: none above the thresholds: compute is 85% of the step at 55.0% MFU"]


def test_unknowns_become_notes_not_guesses(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", regions(comm=None), mfu=None,
                             strategy="fsdp", world_size=2, peak_flops=None,
                             peak_flops_source="unknown GPU"))
    diagnosis = dx.diagnose(run.facts)
    assert diagnosis.findings == ()
    notes = " | ".join(diagnosis.notes)
    assert "MFU unknown" in notes and "unknown GPU" in notes
    assert "not measured under fsdp" in notes
    assert "capacity is unknown" in notes and "process_peak_rss" in notes


def test_unfinished_run_is_diagnosed_from_its_records(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", regions(data=12.0), summary=False))
    assert run.summary is None
    top = dx.diagnose(run.facts).top
    assert top is not None and top.bottleneck == dx.INPUT
    assert "Not finished" in render_report([run])


def test_a_folder_that_is_not_a_run_dir_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a gpuflow run dir"):
        load_run(tmp_path)
    code, _, stderr = report_cli(str(tmp_path))
    assert code == 2
    assert stderr == f"gpuflow: error: {tmp_path} is not a gpuflow run dir (no metrics.jsonl).\n"


def test_train_summary_ends_with_the_top_bottleneck(short_digits_run: tuple[Path, str]) -> None:
    """The printed line names a bottleneck and the share of the step behind it, which is
    worked out here from the run's recorded medians (what a one-process CPU run of digits
    can be diagnosed with: a memory finding needs a known capacity)."""
    run_dir, stdout = short_digits_run
    tail = stdout[stdout.index("run dir"):]
    median = json.loads((run_dir / "summary.json").read_text())["median"]

    def share(region: str) -> str:
        return f"{median[region] / median['step_time_s']:.0%} of the step"

    figures = {
        "input-bound": f"data wait is {share('data_wait_s')}",
        "host/launch-bound": f"host/other time is {share('host_s')}",
        "compute-bound with low MFU":
            f"compute (forward+backward) is {share('compute_s')} at {median['mfu']:.1%}",
        "none above the thresholds": f"compute is {share('compute_s')} at {median['mfu']:.1%}",
    }
    [line] = [line for line in tail.splitlines() if line.startswith("bottleneck: ")]
    name = line.removeprefix("bottleneck: ").split(":")[0]
    assert name in figures and figures[name] in line, (line, median)
    assert f"gpuflow report {run_dir}" in tail


@pytest.fixture(scope="module")
def comparison(short_digits_run: tuple[Path, str],
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`gpuflow report A B` over the real run and a synthetic input-bound one without MFU."""
    other = write_run(tmp_path_factory.mktemp("other") / "slow-input", regions(data=12.0),
                      mfu=None, peak_flops=None, peak_flops_source="unknown device")
    out = other.parent / "compare.html"
    code, stdout, stderr = report_cli(str(short_digits_run[0]), str(other), "--out", str(out))
    assert code == 0, stderr
    assert f"report written to {out}" in stdout
    assert "bottleneck: input-bound" in stdout
    return out


def test_report_of_one_run_has_every_section(short_digits_run: tuple[Path, str]) -> None:
    run_dir, _ = short_digits_run
    code, _, stderr = report_cli(str(run_dir))
    assert code == 0, stderr
    page = (run_dir / "report.html").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    for heading in ("Bottleneck diagnosis", "Summary", "Loss", "Throughput", "MFU", "Memory",
                    "Step-time breakdown", "Configuration", "Hardware and peak FLOP/s",
                    "Versions"):
        assert f">{heading}</h" in page, heading
    assert page.count("<svg") == 5
    for label in ("data wait", "compute", "communication", "optimizer", "host/other"):
        assert f">{label}</text>" in page, label
    assert summary["peak_flops_source"].split(" (")[0] in page
    assert summary["versions"]["torch"] in page
    assert summary["device_name"] in page


def test_report_is_self_contained(comparison: Path) -> None:
    page = comparison.read_text()
    assert "<script" not in page
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:|#)""", page)
    assert "@import" not in page and "url(" not in page.replace('url(#', '')


def test_comparison_shares_plots_and_table(comparison: Path) -> None:
    page = comparison.read_text()
    assert "digits-run vs slow-input" in page
    assert "slow-input / digits-run" in page  # the ratio column
    assert page.count("<svg") == 5
    loss_svg = page[page.index(">Loss</h3>"):page.index(">Throughput</h3>")]
    assert "digits-run" in loss_svg and "slow-input" in loss_svg
    mfu_section = page[page.index(">MFU</h3>"):page.index(">Memory</h3>")]
    assert "unknown (no peak FLOP/s for the device) in: slow-input" in mfu_section
    assert "slow-input" not in mfu_section.split("<figcaption>")[0]  # no zeros drawn for it
    assert 'class="differs"' in page


def test_report_renders_in_a_real_browser(comparison: Path, tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        if os.environ.get("GPUFLOW_REQUIRE_BROWSER"):
            pytest.fail(f"GPUFLOW_REQUIRE_BROWSER is set but {CHROMIUM} is missing")
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    from PIL import Image
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.on("request", lambda r: problems.append(r.url)
                    if not r.url.startswith(("file:", "data:")) else None)
            page.goto(comparison.as_uri(), wait_until="load")
            assert page.title() == "gpuflow report: digits-run vs slow-input"
            plots = page.locator("svg")
            assert plots.count() == 5
            shots = [plots.nth(i).screenshot() for i in range(plots.count())]
        finally:
            browser.close()
    assert problems == []
    for shot in shots:
        image = Image.open(io.BytesIO(shot)).convert("RGB")
        assert image.width > 300 and image.height > 150
        colors = image.getcolors(maxcolors=1 << 16)
        assert colors is not None and len(colors) > 20  # axes, lines and text, not a blank box
        dark = sum(count for count, rgb in colors if sum(rgb) < 600)
        assert dark > 0.01 * image.width * image.height
