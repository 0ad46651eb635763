"""Combining the ranks' reports on their data: counts add over replicas, not over peers."""

from __future__ import annotations

from gpuflow.train.data_report import all_ranks_report, combine


def test_counts_add_and_the_first_named_entry_is_kept() -> None:
    reports = [{"skipped_files": 0, "first_skipped": None, "decode": "gpu"},
               {"skipped_files": 3, "first_skipped": "b.jpg: truncated", "decode": "gpu"},
               {"skipped_files": 2, "first_skipped": "c.jpg: truncated", "decode": "gpu"}]
    assert combine(reports) == {"skipped_files": 5, "first_skipped": "b.jpg: truncated",
                                "decode": "gpu"}
    # Peers of one replica read the same batches: the largest count, not their sum.
    assert combine(reports, add=False)["skipped_files"] == 3


def test_one_process_reports_its_own_and_a_workload_without_one_none() -> None:
    own = {"skipped_files": 4, "first_skipped": "a.png: not an image"}
    assert all_ranks_report(lambda: own, dp_rank=0, world_size=1) == own
    assert all_ranks_report(None, dp_rank=0, world_size=1) is None
