"""The workload's report on its data (``Workload.data_report``), over every rank.

Each data-parallel rank's loader meets only its share of the data, so what one rank counts
(files skipped for not decoding, say) is its share's. At the end of the run every rank's
report is gathered: ranks of one data-parallel replica (tensor- or pipeline-parallel
peers) read the same batches, so their counts are not added but the largest is kept (a
peer that ran no loader counts 0); the replicas' counts are then added. An entry that is
not an integer is the first one given (rank order) that is not None: the first file
skipped, say.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

Report = Mapping[str, Any]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def combine(reports: Sequence[Report], add: bool = True) -> dict[str, Any]:
    """One report of several: counts added (``add``) or their largest kept; any other
    entry the first that is not None."""
    combined: dict[str, Any] = {}
    for report in reports:
        for key, value in report.items():
            if _is_count(value) and _is_count(combined.get(key)):
                combined[key] = combined[key] + value if add else max(combined[key], value)
            elif combined.get(key) is None:
                combined[key] = value
    return combined


def all_ranks_report(report: Callable[[], Report] | None, dp_rank: int,
                     world_size: int) -> dict[str, Any] | None:
    """The workload's report over all ranks (a collective: every rank calls it), for the
    run's summary; None for a workload that reports nothing."""
    if report is None:
        return None
    own = dict(report())
    if world_size == 1:
        return own
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (dp_rank, own))
    replicas: dict[int, list[Report]] = {}
    for rank, given in gathered:
        replicas.setdefault(rank, []).append(given)
    return combine([combine(replicas[rank], add=False) for rank in sorted(replicas)])
