"""benchmarks/gpu_suite.sh: its dry run walks every stage on the CPU, so the one GPU call
has no untried path; what a CPU cannot run (fp8, CUDA graphs, plan --measure) is recorded
as refused, with the reason, and judged not measured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_queue  # noqa: E402
import gpu_stages  # noqa: E402
import gpu_suite  # noqa: E402
import render_docs  # noqa: E402


def test_the_dry_run_walks_every_stage_and_records_where_it_came_from(tmp_path: Path) -> None:
    script = ROOT / "benchmarks" / "gpu_suite.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    out = tmp_path / "suite.json"
    result = subprocess.run(["bash", str(script), "--dry-run", "--out", str(out), "--workdir",
                             str(tmp_path / "work"), "--stages", ",".join(gpu_suite.STAGES)],
                            capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    suite = json.loads(out.read_text())
    # Provenance, recorded by the script: the command as run, commit, versions, date.
    assert suite["dry_run"] is True and suite["partial"] is True
    assert suite["command"].endswith(f"--stages {','.join(gpu_suite.STAGES)}")
    assert "--dry-run" in suite["command"]
    assert re.fullmatch(r"[0-9a-f]{40}", suite["git"]["commit"])
    assert isinstance(suite["git"]["dirty"], bool)
    assert suite["versions"]["torch"] == torch.__version__
    assert suite["created"].startswith("20")
    assert suite["matmul"]["bf16_tflops"] > 0
    assert "skipped" not in suite  # nothing cut for the budget
    runs = {run["label"]: run for run in suite["train"] + suite["cuda_graphs"]}
    for label in ("dry-bf16", "graphs-off"):
        assert runs[label]["tokens_per_s"] > 0 and runs[label]["mfu"] is not None, runs[label]
    # --strategy auto puts the planner's predictions next to the measurements
    assert runs["dry-bf16"]["planner"]["step_time_s"]["predicted"] > 0
    assert runs["dry-bf16"]["planner"]["step_time_s"]["measured"] > 0
    assert runs["dry-fp8"]["refused"].startswith("--precision fp8 needs an NVIDIA GPU")
    assert runs["graphs-on"]["refused"].startswith("--cuda-graphs records CUDA graphs")
    verdicts = suite["verdicts"]
    fp8_verdict = verdicts[f"fp8 vs bf16 {gpu_suite.DRY_MODEL}"]
    assert fp8_verdict["measured"] is False and "dry-fp8: --precision fp8" in fp8_verdict["why"]
    assert verdicts["cuda graphs"]["measured"] is False
    assert verdicts["planner"]["target_max"] == 0.15
    plan = suite["plan"]
    assert plan["default"]["efficiency_source"].startswith("default 0.45")
    assert plan["default"]["step_time_s"] > 0 and "step_error_vs_train" in plan["default"]
    assert "has no GPU" in plan["measured"]["refused"]
    assert suite["batch_size_auto"]["probe"]["micro_batch"] >= 1, suite["batch_size_auto"]
    resumed = suite["fp16_resume"]
    assert resumed["steps"] == resumed["resumed_to"], resumed
    assert suite["serving"]["runs"]["dynamic"]["errors"] == 0, suite["serving"]
    generation = suite["generation"]
    assert generation["tokens_per_s"]["gpuflow"]["4"] > 0, generation
    assert generation["gpuflow_runs_on"]["decode"] == "decode eager, one row per running sequence"
    assert verdicts["generation vs vllm"] == {
        "measured": False, "why": "vLLM is not installed here: no vLLM contender"}
    # Issue 50's stage walks its whole path on one tiny model: server, load, /metrics, judging.
    real = suite["generation_real"]
    assert real["exit_code"] == 0 and real["dry_run"] is True, real
    tiny = real["models"]["tiny-llama"]
    assert tiny["server"]["runs_on"].startswith("cpu") and tiny["server"]["decode"], tiny
    assert tiny["prompt_tokens"]["server"] == tiny["prompt_tokens"]["tokenizer"] > 0, tiny
    for clients in ("1", "2"):
        got = tiny["levels"][clients]
        assert got["errors"] == 0 and got["tokens_per_s"] > 0, got
        assert got["ttft_p99_ms"] >= got["ttft_p50_ms"] > 0, got
        assert got["itl_p99_ms"] >= got["itl_p50_ms"] > 0, got
        assert got["engine"]["steps"] > 0 and got["engine"]["graphed_step_share"] == 0.0, got
    assert "skipped" in real["models"]["smollm2"]  # looked for, not served in a dry run
    assert verdicts["generation-real tiny-llama tokens_per_s c1"]["dry_run"] is True
    assert verdicts["generation-real llama-1b tokens_per_s c256"]["measured"] is False
    compared = suite["compare_trainers"]
    assert [(c["model"], c["precision"]) for c in compared["cases"]] == [("linear", "fp32")]
    assert compared["cases"][0]["vs_plain"]["gpuflow"]["median_ratio"] > 0, compared
    assert compared["verdicts"][0].startswith("linear fp32: gpuflow/plain "), compared
    fsdp = suite["fsdp_comm"]
    assert fsdp["exit_code"] == 0 and fsdp["measured"] and fsdp["parts_add_up"], fsdp
    # The docs page names the file, the commit, and that this was no full GPU run.
    page = "\n".join(render_docs.section(out, suite))
    assert f"measured at commit {suite['git']['commit'][:12]}" in page
    assert "a partial run with chosen settings" in page and "dry run (CPU" in page
    assert "| textlm dry-fp8 | not measured: --precision fp8 needs" in page
    assert f"Source: `benchmarks/results/{out.name}`" in page


def test_a_tree_without_git_records_the_commit_it_was_given(tmp_path: Path) -> None:
    """A lent GPU machine gets a copy of the tree without .git: the launcher passes the
    commit, and the result says where it came from; without it, the commit is unknown."""
    copy = tmp_path / "benchmarks"
    copy.mkdir()
    (copy / "_common.py").write_text((ROOT / "benchmarks" / "_common.py").read_text())
    probe = [sys.executable, "-c", "import json, _common; print(json.dumps(_common.git_commit()))"]

    def recorded(**env: str) -> dict:
        base = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLOW_GIT")}
        done = subprocess.run(probe, cwd=copy, capture_output=True, text=True, check=True,
                              env={**base, "GIT_CEILING_DIRECTORIES": str(tmp_path), **env})
        return json.loads(done.stdout)

    given = recorded(GPUFLOW_GIT_COMMIT="ab" * 20, GPUFLOW_GIT_DIRTY="0")
    assert given == {"commit": "ab" * 20, "dirty": False, "source":
                     "GPUFLOW_GIT_COMMIT and GPUFLOW_GIT_DIRTY (no git checkout here)"}
    assert recorded() == {"commit": None, "dirty": None,
                          "source": "unknown (no git checkout here)"}
    page = "\n".join(render_docs.section(tmp_path / "gpu_suite-x.json", {
        "benchmark": "gpu_suite", "git": given}))
    assert "measured at commit abababababab (from GPUFLOW_GIT_COMMIT" in page


def test_the_wheel_fetcher_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_wheels.sh")], check=True)


def test_the_targets_are_judged_from_the_measured_runs() -> None:
    """judge() on runs shaped as the GPU writes them (the dry run measures no fp8 or graphs)."""
    def run(label: str, size: str, precision: str, tokens: float, step: float,
            loss: float, mfu: float, planner_error: float) -> dict:
        return {"label": label, "model_size": size, "precision": precision,
                "tokens_per_s": tokens, "step_time_s": step, "mfu": mfu, "global_batch": 16,
                "final_metrics": {"val_loss": loss},
                "planner": {"step_time_s": {"error": planner_error}}}

    verdicts = gpu_suite.judge({
        "train": [run("1b-bf16", "1b", "bf16", 70e3, 0.47, 1.50, 0.63, 0.10),
                  run("1b-fp8", "1b", "fp8", 91e3, 0.36, 1.52, 0.82, -0.20)],
        "cuda_graphs": [run("graphs-off", "tiny", "bf16", 1e6, 0.010, 2.0, 0.05, 0.0),
                        {"label": "graphs-on", "model_size": "tiny", "precision": "bf16",
                         "exit_code": 2, "refused": "--cuda-graphs records CUDA graphs"}]})
    assert verdicts["mfu 1b-bf16"] == {"measured": 0.63, "target_min": 0.62, "met": True}
    fp8 = verdicts["fp8 vs bf16 1b"]
    assert fp8["tokens_per_s_ratio"] == pytest.approx(1.3)
    assert fp8["val_loss_rel_diff"] == pytest.approx(0.02 / 1.5) and fp8["met"] is True
    assert verdicts["cuda graphs"] == {"measured": False,
                                       "why": "graphs-on: --cuda-graphs records CUDA graphs"}
    # The planner plans fp8 as bf16: its error there is shown beside the judged ones.
    assert verdicts["planner"] == {"errors": {"1b-bf16 step_time_s": 0.10},
                                   "target_max": 0.15, "met": True}
    assert verdicts["planner, fp8 planned as bf16"] == {"errors": {"1b-fp8 step_time_s": -0.20}}


def test_the_pending_dry_run_lists_the_queue_in_order_with_reasons(tmp_path: Path) -> None:
    """`--pending --dry-run` on this checkout: every stage pending for a reason, in the fixed
    order (the never-measured first), saved for a GPU machine that has no git."""
    names = [stage.name for stage in gpu_stages.STAGES]
    assert names[:7] == ["generation", "generation-real", "fp8-1b", "images", "finetune",
                         "asr", "fashion"]
    for stage in gpu_stages.STAGES:
        assert all(any(ROOT.glob(source)) for source in stage.sources), stage.name
        assert (ROOT / stage.command("nvidia-h100", 300)[0]).is_file(), stage.name
    saved = tmp_path / "queue.json"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--pending",
                           "--dry-run", "--save", str(saved)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    queue = gpu_queue.Queue.load(saved)
    assert header.startswith(f"GPU queue at {queue.commit[:12]}: {len(lines)} of {len(names)}")
    listed = [line.split()[1] for line in lines]
    assert listed == [stage.name for stage, _ in queue.pending]
    assert listed == sorted(listed, key=names.index)
    for line in lines:
        assert re.search(r" s  (missing|stale since commit [0-9a-f]{7,} \(\d+ commits? after "
                         r"\S+\.json's [0-9a-f]{7}\): \S)", line), line


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_a_stage_is_missing_fresh_or_stale_by_its_sources_commits(tmp_path: Path) -> None:
    repo, results = tmp_path / "repo", tmp_path / "repo" / "results"
    (repo / "src").mkdir(parents=True)
    results.mkdir()
    stage = gpu_stages.Stage("s", "", ("src/measured.py",), "s-*.json",
                             lambda result: "figure" in result, lambda gpu, left: [], 1,
                             lambda result: "")
    _git(repo, "init", "-q")
    (repo / "src" / "measured.py").write_text("1\n")
    (repo / "src" / "other.py").write_text("1\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "code")
    measured = _git(repo, "rev-parse", "HEAD")
    assert gpu_queue.reason(stage, repo, results) == "missing"
    (results / "s-gpu.json").write_text(json.dumps({"dry_run": True, "figure": 1}))
    assert gpu_queue.reason(stage, repo, results) == "missing"  # a dry run measures nothing
    (results / "s-gpu.json").write_text(json.dumps({"git": {"commit": measured}, "figure": 1}))
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "results")
    (repo / "src" / "other.py").write_text("2\n")
    _git(repo, "commit", "-qam", "other code")
    assert gpu_queue.reason(stage, repo, results) is None
    (repo / "src" / "measured.py").write_text("2\n")
    _git(repo, "commit", "-qam", "measured code")
    changed = _git(repo, "rev-parse", "--short=7", "HEAD")
    assert gpu_queue.reason(stage, repo, results) == (
        f"stale since commit {changed} (1 commit after s-gpu.json's {measured[:7]}): "
        "src/measured.py")
    # No commit recorded: the file stands for the commit that last wrote it.
    (results / "s-gpu.json").write_text(json.dumps({"figure": 2}))
    _git(repo, "commit", "-qam", "results without a commit")
    assert gpu_queue.reason(stage, repo, results) is None
    assert gpu_queue.pending(tmp_path / "no-git", results) is None


def test_the_queue_runs_what_fits_the_budget_and_stops_at_its_end() -> None:
    def stage(name: str, estimate_s: float, code: str) -> gpu_stages.Stage:
        return gpu_stages.Stage(name, "", (), "", lambda result: False,
                                lambda gpu, left: ["-c", code], estimate_s, lambda result: "")

    queue = gpu_queue.Queue("c" * 40, False, [(stage("big", 99, "pass"), "missing"),
                                              (stage("quick", 0, "pass"), "missing"),
                                              (stage("slow", 0, "import time; time.sleep(30)"),
                                               "stale")])
    big, quick, slow = gpu_queue.run(queue, budget_s=1.5, gpu="gpu")
    assert big["skipped"].startswith("needs ~99 s")
    assert quick["exit_code"] == 0
    assert slow["exit_code"] is None and slow["stopped"].startswith("at the budget's end")


def test_the_gpu_figures_in_the_docs_are_rendered_from_the_results() -> None:
    page = render_docs.PERFORMANCE.read_text()
    assert render_docs.with_gpu_table(page) == page, "run benchmarks/render_docs.py"
    assert "| `generation` |" in page and "| never measured |" in page
