"""The digits workload's scans: scikit-learn's own, read without importing scikit-learn."""

from __future__ import annotations

import subprocess
import sys

import torch
from sklearn.datasets import load_digits

from gpuflow.workloads import digits


def test_scans_equal_scikit_learns_and_load_without_importing_it() -> None:
    assert digits.bundled_digits_file() is not None
    images, labels = digits.load_digits_tensors()
    reference = load_digits()
    assert torch.equal(images, torch.tensor(reference.images, dtype=torch.float32)
                       .unsqueeze(1) / 16.0)
    assert torch.equal(labels, torch.tensor(reference.target, dtype=torch.int64))
    # scikit-learn's import alone costs about 2 s of every digits run's start-up.
    fresh = subprocess.run(
        [sys.executable, "-c", "import sys; from gpuflow.workloads import digits; "
         "digits.build(); print('sklearn' in sys.modules)"],
        capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "False", fresh.stderr
