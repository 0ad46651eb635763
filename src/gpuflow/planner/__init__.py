"""The planner: predicts memory per device and step time for candidate parallel plans.

``choose_plan`` and ``find_max_batch_size`` are the entry points the trainer uses;
``gpuflow plan`` prints the whole table.
"""

from gpuflow.planner.batch_size import find_max_batch_size
from gpuflow.planner.search import Plan, choose_plan

__all__ = ["Plan", "choose_plan", "find_max_batch_size"]
