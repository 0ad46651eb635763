"""The planner's compute efficiency, measured by training the real model for a few steps.

The planner times compute as FLOPs over the dense peak times an efficiency. A matmul probe
measures the device's best case, not what a training step sustains (attention, norms, the
optimizer, kernel launches); a short run of the workload does. Its MFU (the trainer's FLOP
count over the measured step time and the datasheet peak) is the efficiency under which
the planner's one-device prediction equals that measurement.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from dataclasses import dataclass
from typing import Any

from gpuflow.config import TrainConfig
from gpuflow.devices import device_name
from gpuflow.errors import UserError
from gpuflow.train.trainer import Trainer
from gpuflow.workload import Workload

MEASURE_STEPS = 12
LOG_EVERY = 3  # four windows; the first, which holds the warm-up, is left out


@dataclass(frozen=True)
class MeasuredEfficiency:
    """One measured run, recorded with the plan it calibrates."""

    efficiency: float
    step_time_s: float
    flops_per_step: int
    peak_flops: float
    peak_source: str
    device_name: str
    workload: str
    precision: str
    micro_batch: int
    steps: int
    compiled: bool

    def describe(self) -> str:
        return (f"measured: MFU {self.efficiency:.3f} of {self.workload} ({self.precision}, "
                f"micro-batch {self.micro_batch}{', compiled' if self.compiled else ''}, "
                f"median of steps {LOG_EVERY + 1}-{self.steps}: {self.step_time_s * 1e3:.1f} "
                f"ms) on {self.device_name}, against {self.peak_flops / 1e12:.1f} TFLOP/s "
                f"({self.peak_source})")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def measure_efficiency(workload: Workload, precision: str, micro_batch: int, *,
                       device: str = "cuda", compile: bool = False,
                       steps: int = MEASURE_STEPS) -> MeasuredEfficiency:
    """Train ``workload`` for ``steps`` steps on one device; its MFU is the efficiency."""
    with tempfile.TemporaryDirectory(prefix="gpuflow-measure-") as run_dir:
        config = TrainConfig(workload=workload.name, device=device, precision=precision,
                             batch_size=micro_batch, max_steps=steps, log_every=LOG_EVERY,
                             warmup_steps=1, eval_every=0, save_checkpoints=False,
                             progress=False, strategy="single", compile=compile,
                             run_dir=run_dir)
        trainer = Trainer(workload, config)
        try:
            trainer.run_steps(steps)
            records = list(trainer.metrics.step_records())
        finally:
            trainer.close()
    if trainer.peak.flops is None:
        raise UserError(f"plan --measure: the {precision} peak of {trainer.device} is unknown "
                        f"({trainer.peak.source}), so no efficiency can be measured against "
                        "it; give --efficiency instead.")
    step_time = statistics.median(r["step_time_s"] for r in records[1:] or records)
    return MeasuredEfficiency(
        efficiency=trainer.flops_per_step / step_time / trainer.peak.flops,
        step_time_s=step_time, flops_per_step=trainer.flops_per_step,
        peak_flops=trainer.peak.flops, peak_source=trainer.peak.source,
        device_name=device_name(trainer.device), workload=workload.name, precision=precision,
        micro_batch=micro_batch, steps=steps, compiled=trainer.compiled is not None)
