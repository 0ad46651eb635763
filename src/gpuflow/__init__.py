"""gpuflow: train and serve PyTorch models with the accelerator busy, and show where time goes."""

from gpuflow.config import TrainConfig
from gpuflow.errors import UserError
from gpuflow.serving import ServingSpec
from gpuflow.train.loop import RunResult, Trainer, train
from gpuflow.workload import Workload, accuracy, cross_entropy, resolve_workload

__all__ = [
    "RunResult",
    "ServingSpec",
    "TrainConfig",
    "Trainer",
    "UserError",
    "Workload",
    "accuracy",
    "cross_entropy",
    "resolve_workload",
    "train",
]
__version__ = "0.1.0"
