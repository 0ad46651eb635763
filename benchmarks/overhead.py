"""What gpuflow's engine costs over a plain PyTorch loop, and whether it trains identically.

The same model, data, precision and batch size are trained by ``gpuflow.Trainer`` (telemetry
and metrics.jsonl logging on), by a hand-written loop and, when installed, by Lightning
Fabric. The loops take turns in rounds inside one process, in a rotating order, so machine
drift (clock boost, a noisy neighbour) hits all of them alike; each round gives a ratio and
an extra time per step against the plain loop, and their medians are reported with a
bootstrap 95% interval. A second plain loop (the A/A control) shows how far apart two
identical loops land on this machine, which is the finest difference the run can resolve.
At the end the final weights must equal the plain loop's bit for bit: overhead is only
worth measuring if the engine computes exactly the same thing.

Run: ``python benchmarks/overhead.py`` (about 3-5 minutes on 2 cores), or ``--quick``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpuflow
from gpuflow.data.sampler import ResumableSampler
from gpuflow.models.cnn import SmallCNN

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

SEED = 0
LR = 1e-3
WEIGHT_DECAY = 0.1
LOG_EVERY = 10
RATIO_TARGET = 1.01
FOREIGN_LOAD_WARN = 0.05
# Fabric's extra time per step on the near-zero model, measured on the 2-core dev machine;
# the bar for gpuflow when Fabric cannot be measured alongside.
FABRIC_REFERENCE_EXTRA_MS = 0.15
CPU = torch.device("cpu")


class TinyTransformer(nn.Module):
    """Pre-norm transformer classifier over token ids: small enough for a CPU benchmark."""

    def __init__(self, vocab: int = 256, d_model: int = 128, heads: int = 4, layers: int = 2,
                 seq_len: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model,
                                       dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: how to build it and its data, and a round size that suits it."""

    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator], torch.Tensor]
    batch_size: int
    about: str


MODELS: dict[str, ModelSpec] = {
    "linear": ModelSpec(
        build=lambda: nn.Linear(32, 10),
        inputs=lambda n, gen: torch.randn(n, 32, generator=gen),
        batch_size=16,
        about="one Linear(32, 10): the step is almost pure loop overhead",
    ),
    "cnn": ModelSpec(
        build=lambda: SmallCNN(in_channels=1, num_classes=10, width=16, depth=2, dropout=0.0),
        inputs=lambda n, gen: torch.randn(n, 1, 16, 16, generator=gen),
        batch_size=32,
        about="SmallCNN width 16, depth 2, 1x16x16 images, dropout 0",
    ),
    "transformer": ModelSpec(
        build=TinyTransformer,
        inputs=lambda n, gen: torch.randint(0, 256, (n, 64), generator=gen),
        batch_size=16,
        about="pre-norm transformer d=128, 2 layers, 4 heads, seq 64",
    ),
}


class Loop(Protocol):
    """One way of training: runs steps on demand and exposes the trained module."""

    name: str
    module: nn.Module

    def run(self, steps: int) -> None: ...

    def close(self) -> None: ...


def make_dataset(spec: ModelSpec) -> TensorDataset:
    """Seeded synthetic data; 40 batches and a remainder, so epochs wrap and drop_last acts."""
    gen = torch.Generator().manual_seed(SEED)
    count = spec.batch_size * 40 + 5
    return TensorDataset(spec.inputs(count, gen), torch.randint(0, 10, (count,), generator=gen))


def adamw_like_gpuflow(model: nn.Module) -> torch.optim.AdamW:
    """The optimizer gpuflow builds, written out by hand: decay on matrices only, fused
    kernels (gpuflow's choice on the CPU and CUDA)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), fused=True)


def endless(loader: Any, sampler: ResumableSampler) -> Iterator[tuple[torch.Tensor, ...]]:
    """Epoch after epoch of the same seeded order gpuflow's loader draws."""
    epoch = 0
    while True:
        sampler.set_position(epoch, 0)
        yield from loader
        epoch += 1


def plain_loader(dataset: TensorDataset, batch_size: int) -> tuple[DataLoader, ResumableSampler]:
    sampler = ResumableSampler(len(dataset), SEED)
    # A seeded generator keeps the loader off the global RNG, as gpuflow's loader does.
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator().manual_seed(SEED))
    return loader, sampler


class PlainLoop:
    """The baseline: the loop one would write by hand, reading the loss every step."""

    def __init__(self, model: nn.Module, dataset: TensorDataset, batch_size: int,
                 precision: str, device: torch.device = CPU, name: str = "plain") -> None:
        self.name = name
        self.device = device
        self.module = model.to(device).train()
        self.optimizer = adamw_like_gpuflow(model)
        self.batches = endless(*plain_loader(dataset, batch_size))
        self.bf16 = precision == "bf16"

    def run(self, steps: int) -> None:
        model, optimizer, device = self.module, self.optimizer, self.device
        for _ in range(steps):
            x, y = next(self.batches)
            if device.type != "cpu":
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if self.bf16:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).float(), y)
            else:
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            loss.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class GpuflowLoop:
    """gpuflow's Trainer driven round by round; run_steps includes telemetry and logging."""

    name = "gpuflow"

    def __init__(self, model: nn.Module, dataset: TensorDataset, batch_size: int,
                 precision: str, total_steps: int, run_dir: Path, device: torch.device = CPU
                 ) -> None:
        config = gpuflow.TrainConfig(
            max_steps=total_steps, schedule="constant", warmup_steps=0, lr=LR,
            weight_decay=WEIGHT_DECAY, precision=precision,  # type: ignore[arg-type]
            batch_size=batch_size, log_every=LOG_EVERY, eval_every=0, checkpoint_every=0,
            progress=False, run_dir=str(run_dir), device=device.type, seed=SEED,
        )
        workload = gpuflow.Workload(name="overhead-bench", model=model, train_dataset=dataset)
        self.trainer = gpuflow.Trainer(workload, config)
        self.module = self.trainer.model

    def run(self, steps: int) -> None:
        self.trainer.run_steps(steps)

    def close(self) -> None:
        self.trainer.close()


def import_fabric() -> tuple[Any, str | None, str | None]:
    """Fabric's class and version, or None and why it cannot be measured."""
    errors = []
    for module_name, dist in (("lightning_fabric", "lightning-fabric"),
                              ("lightning.fabric", "lightning")):
        try:
            module = __import__(module_name, fromlist=["Fabric"])
        except ImportError as exc:
            errors.append(f"{module_name}: {exc}")
            continue
        return module.Fabric, _common.package_version(dist), None
    return None, None, "not importable (" + "; ".join(errors) + ")"


class FrameworkLoop:
    """The plain loop's step through a framework's wrapped model, optimizer and loader;
    frameworks differ in set-up and in ``backward``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Iterator[Any]
    backward: Callable[[torch.Tensor], Any]  # the framework's, set up by the subclass

    def run(self, steps: int) -> None:
        model, optimizer = self.model, self.optimizer
        for _ in range(steps):
            x, y = next(self.batches)
            loss = F.cross_entropy(model(x).float(), y)
            self.backward(loss)
            loss.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class FabricLoop(FrameworkLoop):
    """The same loop through Lightning Fabric's wrappers, for a reference overhead."""

    name = "fabric"

    def __init__(self, fabric_cls: Any, model: nn.Module, dataset: TensorDataset,
                 batch_size: int, precision: str, device: torch.device = CPU) -> None:
        self.module = model.train()
        fabric = fabric_cls(accelerator=device.type, devices=1,
                            precision="bf16-mixed" if precision == "bf16" else "32-true")
        self.fabric = fabric
        self.model, self.optimizer = fabric.setup(model, adamw_like_gpuflow(model))
        loader, sampler = plain_loader(dataset, batch_size)
        self.batches = endless(fabric.setup_dataloaders(loader, use_distributed_sampler=False),
                               sampler)
        self.backward = fabric.backward


def timed_rounds(loops: list[Any], steps: int, warmup_rounds: int, rounds: int
                 ) -> tuple[dict[str, list[float]], float, float | None]:
    """Run every loop ``steps`` steps a round, in a rotating order, and close them.

    Returns each loop's timed round durations (after the warm-up rounds), the wall time and
    the CPU share other processes used meanwhile.
    """
    times: dict[str, list[float]] = {loop.name: [] for loop in loops}
    # Set-up garbage (Fabric's import above all) is frozen out of reach of the collector, so
    # collections in the rounds cost what the loops themselves allocate, not a random toll.
    gc.collect()
    gc.freeze()
    started, foreign = time.perf_counter(), _common.ForeignLoad()
    for index in range(warmup_rounds + rounds):
        shift = index % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            begin = time.perf_counter()
            loop.run(steps)
            elapsed = time.perf_counter() - begin
            if index >= warmup_rounds:
                times[loop.name].append(elapsed)
    wall, foreign_share = time.perf_counter() - started, foreign.share()
    gc.unfreeze()
    for loop in loops:
        loop.close()
    return times, wall, foreign_share


def compare_weights(reference: nn.Module, other: nn.Module) -> dict[str, Any]:
    """torch.equal on every state_dict tensor; on a mismatch, which ones and by how much."""
    ref, got = reference.state_dict(), other.state_dict()
    mismatched = [name for name in ref if name not in got or not torch.equal(ref[name], got[name])]
    diffs = [(ref[name].double() - got[name].double()).abs().max().item()
             for name in mismatched if name in got and ref[name].shape == got[name].shape]
    return {
        "bitwise_equal": not mismatched and ref.keys() == got.keys(),
        "mismatched": mismatched,
        "max_abs_diff": max(diffs, default=0.0),
    }


def changed(before: dict[str, torch.Tensor], module: nn.Module) -> bool:
    """Whether training moved the weights at all: equality of untrained copies proves nothing."""
    after = module.state_dict()
    return any(not torch.equal(before[name], after[name].cpu()) for name in before)


def median_ci(values: list[float], resamples: int = 2000) -> list[float]:
    """Bootstrap 95% interval of the median: how far this machine's noise lets us see."""
    if len(values) < 2:
        return [values[0], values[0]] if values else [math.nan, math.nan]
    rng = random.Random(SEED)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def paired(times: dict[str, list[float]], name: str, against: str, steps: int
           ) -> tuple[list[float], list[float]]:
    """Per-round ratios and extra ms/step of ``name`` over ``against`` (same round)."""
    pairs = list(zip(times[name], times[against], strict=True))
    return [t / r for t, r in pairs], [(t - r) / steps * 1e3 for t, r in pairs]


def summarize(times: dict[str, list[float]], steps: int) -> dict[str, Any]:
    """Medians of per-step time, and per-round ratio and extra ms/step against plain."""
    out: dict[str, Any] = {
        "median_step_ms": {name: statistics.median(ts) / steps * 1e3
                           for name, ts in times.items()},
    }
    for name, ts in times.items():
        if name == "plain":
            continue
        ratios, extra = paired(times, name, "plain", steps)
        out[name] = {
            "median_ratio": statistics.median(ratios),
            "median_ratio_ci95": median_ci(ratios),
            "total_time_ratio": sum(ts) / sum(times["plain"]),
            "extra_ms_per_step": statistics.median(extra),
            "extra_ms_per_step_ci95": median_ci(extra),
        }
    if "fabric" in times:
        _, extra = paired(times, "gpuflow", "fabric", steps)
        out["gpuflow_minus_fabric_ms_per_step"] = {"median": statistics.median(extra),
                                                  "ci95": median_ci(extra)}
    return out


def calibrate(base: nn.Module, dataset: TensorDataset, batch_size: int, precision: str,
              round_seconds: float, device: torch.device = CPU) -> int:
    """Steps per round so that one loop's round lasts about ``round_seconds``.

    Sized per machine, since a bf16 step is 4x faster than fp32 on an AMX CPU and 10x
    slower on one without bf16 units. Above LOG_EVERY the count is a multiple of it, so
    every round holds the same number of gpuflow's log writes.
    """
    probe = PlainLoop(copy.deepcopy(base), dataset, batch_size, precision, device)
    probe.run(1)
    count = 1
    while True:
        begin = time.perf_counter()
        probe.run(count)
        elapsed = time.perf_counter() - begin
        if elapsed >= min(0.05, round_seconds / 4) or count >= 4096:
            break
        count *= 2
    if elapsed < round_seconds / 4:
        # The fastest of a few tries: a burst of foreign load must not shrink the rounds.
        for _ in range(2):
            begin = time.perf_counter()
            probe.run(count)
            elapsed = min(elapsed, time.perf_counter() - begin)
    steps = max(1, round(round_seconds * count / elapsed))
    return max(LOG_EVERY, round(steps / LOG_EVERY) * LOG_EVERY) if steps >= LOG_EVERY else steps


def run_case(model_name: str, precision: str, rounds: int, warmup_rounds: int,
             steps: int | None, round_seconds: float, fabric_cls: Any, control: bool,
             workdir: Path, device: torch.device = CPU) -> dict[str, Any]:
    """Train one model several ways in interleaved rounds; time them and compare weights.

    The control is a second plain loop: its ratio to the first shows what "no difference"
    looks like on this machine.
    """
    spec = MODELS[model_name]
    dataset = make_dataset(spec)
    torch.manual_seed(SEED)
    base = spec.build()
    initial = copy.deepcopy(base.state_dict())
    calibrated = steps is None
    if steps is None:
        steps = calibrate(base, dataset, spec.batch_size, precision, round_seconds, device)
    total_steps = (warmup_rounds + rounds) * steps
    loops: list[Loop] = [PlainLoop(copy.deepcopy(base), dataset, spec.batch_size, precision,
                                   device)]
    if control:
        loops.append(PlainLoop(copy.deepcopy(base), dataset, spec.batch_size, precision,
                               device, name="control"))
    if fabric_cls is not None:
        loops.append(FabricLoop(fabric_cls, copy.deepcopy(base), dataset, spec.batch_size,
                                precision, device))
    run_dir = workdir / f"{model_name}-{precision}"
    loops.append(GpuflowLoop(base, dataset, spec.batch_size, precision, total_steps, run_dir,
                             device))

    times, wall, foreign_share = timed_rounds(loops, steps, warmup_rounds, rounds)

    by_name = {loop.name: loop for loop in loops}
    plain = by_name["plain"].module
    gpuflow_steps = by_name["gpuflow"].trainer.step  # type: ignore[attr-defined]
    result: dict[str, Any] = {
        "model": model_name,
        "about": spec.about,
        "precision": precision,
        "batch_size": spec.batch_size,
        "steps_per_round": steps,
        "steps_calibrated": calibrated,
        "rounds": rounds,
        "warmup_rounds": warmup_rounds,
        "total_steps": total_steps,
        "gpuflow_steps_run": gpuflow_steps,
        "wall_s": wall,
        "foreign_cpu_share": foreign_share,
        **summarize(times, steps),
        "weights_changed": changed(initial, plain),
        "round_times_s": times,
    }
    comparison = compare_weights(plain, by_name["gpuflow"].module)
    result["bitwise_equal"] = comparison["bitwise_equal"] and gpuflow_steps == total_steps
    result["weights_vs_plain"] = {"gpuflow": comparison}
    for name in ("control", "fabric"):
        if name in by_name:
            result["weights_vs_plain"][name] = compare_weights(plain, by_name[name].module)
    result["target"] = target_for(result)
    return result


def target_for(case: dict[str, Any]) -> dict[str, Any]:
    """The issue's bar: ratio <= 1.01 on real models; no more extra time than Fabric's on
    the near-zero one (the dev machine's Fabric figure when Fabric is not measured).

    ``resolved`` says whether the 95% interval lies wholly on one side of the limit; when
    it does not, this machine's noise is too large to tell, whatever the median says.
    """
    gpuflow_stats = case["gpuflow"]
    if case["model"] != "linear":
        value, limit = gpuflow_stats["median_ratio"], RATIO_TARGET
        low, high = gpuflow_stats["median_ratio_ci95"]
        return {"metric": "median_ratio", "value": value, "limit": limit, "ci95": [low, high],
                "met": value <= limit, "resolved": high <= limit or low > limit}
    value = gpuflow_stats["extra_ms_per_step"]
    if "fabric" in case:
        limit, source = case["fabric"]["extra_ms_per_step"], "fabric measured alongside"
        diff_low, diff_high = case["gpuflow_minus_fabric_ms_per_step"]["ci95"]
        resolved = diff_high <= 0 or diff_low > 0
    else:
        limit, source = FABRIC_REFERENCE_EXTRA_MS, "fabric reference from the dev machine"
        low, high = gpuflow_stats["extra_ms_per_step_ci95"]
        resolved = high <= limit or low > limit
    return {"metric": "extra_ms_per_step", "value": value, "limit": limit,
            "limit_source": source, "met": value <= limit, "resolved": resolved}


def implied_ratios(cases: list[dict[str, Any]]) -> None:
    """The ratio each model would show if gpuflow's cost were only the near-zero model's
    extra time per step: a far finer figure than a noisy ratio of two long steps."""
    extra = {c["precision"]: c["gpuflow"]["extra_ms_per_step"]
             for c in cases if c["model"] == "linear"}
    for case in cases:
        if case["model"] != "linear" and case["precision"] in extra:
            plain_ms = case["median_step_ms"]["plain"]
            case["gpuflow"]["implied_ratio_from_linear"] = 1 + extra[case["precision"]] / plain_ms


def format_table(cases: list[dict[str, Any]]) -> str:
    header = (f"{'model':<12}{'prec':<5}{'batch':>6}{'rounds x steps':>15}{'plain ms':>10}"
              f"{'gpuflow ms':>11}{'fabric ms':>10}{'gf ratio [95% CI]':>25}{'gf +ms':>8}"
              f"{'fab ratio':>10}{'fab +ms':>8}{'A/A':>8}{'other%':>7}  {'bitwise':<8}target")
    lines = [header, "-" * len(header)]

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for case in cases:
        step_ms, gf = case["median_step_ms"], case["gpuflow"]
        fabric = case.get("fabric", {})
        target = case["target"]
        verdict = "met" if target["met"] else "MISSED"
        if not target["resolved"]:
            verdict += " (within noise)"
        other = case["foreign_cpu_share"]
        low, high = gf["median_ratio_ci95"]
        lines.append(
            f"{case['model']:<12}{case['precision']:<5}{case['batch_size']:>6}"
            f"{case['rounds']:>10}x{case['steps_per_round']:<4}"
            f"{step_ms['plain']:>10.3f}{step_ms['gpuflow']:>11.3f}"
            f"{num(step_ms.get('fabric'), '.3f'):>10}"
            f"{gf['median_ratio']:>9.4f} [{low:.3f}, {high:.3f}]"
            f"{gf['extra_ms_per_step']:>+8.3f}"
            f"{num(fabric.get('median_ratio'), '.4f'):>10}"
            f"{num(fabric.get('extra_ms_per_step'), '+.3f'):>8}"
            f"{num(case.get('control', {}).get('median_ratio'), '.4f'):>8}"
            f"{num(None if other is None else 100 * other, '.0f'):>7}  "
            f"{'yes' if case['bitwise_equal'] else 'NO':<8}"
            f"{target['metric']} {target['value']:.4g} <= {target['limit']:.4g}: {verdict}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds per case")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per round for every case (default: calibrated)")
    parser.add_argument("--round-seconds", type=float, default=0.1,
                        help="calibration target: seconds per round for each loop")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated subset of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--precisions", default=None,
                        help="comma-separated: fp32, bf16 (default: both)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the cores this process may use)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where every loop trains (default cpu)")
    parser.add_argument("--no-fabric", action="store_true", help="skip Lightning Fabric")
    parser.add_argument("--no-control", action="store_true",
                        help="skip the second plain loop that shows the noise floor (A/A)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 rounds x 10 steps, linear fp32 unless --models "
                             "and --precisions say otherwise (a few seconds)")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default: benchmarks/results/overhead-<machine>.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup_rounds, args.steps = 2, 1, args.steps or LOG_EVERY
        args.models, args.precisions = args.models or "linear", args.precisions or "fp32"
    args.models = args.models or ",".join(MODELS)
    args.precisions = args.precisions or "fp32,bf16"
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    unknown += [p for p in args.precisions if p not in ("fp32", "bf16")]
    if unknown:
        parser.error(f"unknown model or precision: {', '.join(unknown)}")
    if args.rounds < 1 or args.warmup_rounds < 0 or (args.steps is not None and args.steps < 1):
        parser.error("--rounds and --steps must be at least 1, --warmup-rounds at least 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    args.device = torch.device(args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or _common.usable_cores())
    if args.no_fabric:
        fabric_cls, fabric_version, fabric_reason = None, None, "disabled by --no-fabric"
    else:
        fabric_cls, fabric_version, fabric_reason = import_fabric()

    cases = []
    with tempfile.TemporaryDirectory(prefix="gpuflow-overhead-") as workdir:
        for model_name in args.models:
            for precision in args.precisions:
                print(f"running {model_name} {precision} ...", file=sys.stderr, flush=True)
                case = run_case(model_name, precision, args.rounds, args.warmup_rounds,
                                args.steps, args.round_seconds, fabric_cls,
                                not args.no_control, Path(workdir), args.device)
                print(f"  done in {case['wall_s']:.1f} s", file=sys.stderr, flush=True)
                share = case["foreign_cpu_share"]
                if share is not None and share > FOREIGN_LOAD_WARN:
                    print(f"  warning: other processes used {100 * share:.0f}% of the CPUs "
                          "meanwhile; these timings are not trustworthy", file=sys.stderr)
                cases.append(case)

    implied_ratios(cases)
    table = format_table(cases)
    print(table)
    print("\nms: median step time over rounds; ratio, +ms: medians of per-round figures "
          "against plain, with a bootstrap 95% interval; A/A: a second plain loop against "
          "the first (what no difference looks like here); other%: CPU share used by other "
          "processes meanwhile")
    for case in cases:
        implied = case["gpuflow"].get("implied_ratio_from_linear")
        if implied is not None:
            print(f"{case['model']} {case['precision']}: ratio implied by the linear model's "
                  f"extra time per step: {implied:.4f}")
    result = {
        "benchmark": "overhead",
        **_common.provenance(lightning_fabric=fabric_version),
        "machine": _common.machine_info(),
        "settings": {
            "rounds": args.rounds, "warmup_rounds": args.warmup_rounds,
            "steps_override": args.steps, "round_seconds": args.round_seconds,
            "control": not args.no_control, "quick": args.quick,
            "device": args.device.type, "seed": SEED, "lr": LR, "weight_decay": WEIGHT_DECAY,
            "log_every": LOG_EVERY,
            "optimizer": "adamw",
            "gpuflow_telemetry": "on (Trainer.run_steps: step timer and metrics.jsonl)",
        },
        "fabric": None if fabric_cls is None else {"version": fabric_version},
        "fabric_reason": fabric_reason,
        "cases": cases,
        "all_bitwise_equal": all(case["bitwise_equal"] for case in cases),
        "all_targets_met": all(case["target"]["met"] for case in cases),
        "table": table.splitlines(),
    }
    out = args.out or _common.default_result_path("overhead")
    _common.write_json(out, result)
    print(f"\nresult written to {out}")
    if not result["all_bitwise_equal"]:
        bad = [f"{c['model']}/{c['precision']}" for c in cases if not c["bitwise_equal"]]
        print(f"ERROR: gpuflow's weights differ from the plain loop's in {', '.join(bad)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
