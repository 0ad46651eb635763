"""CUDA graphs from any thread, on the torch versions whose graph trees allow only one.

torch.compile's ``mode="reduce-overhead"`` keeps its CUDA-graph trees in per-thread state
that torch 2.11 (and older) sets up only in the thread that first imported
``torch._inductor.cudagraph_trees`` and in autograd's own threads: in any other thread the
first graph fails a bare ``assert`` (an ``AssertionError`` with no message). The server
compiles in two threads (the predict batcher's, then the generation engine's), so the
second one failed on the H200 under torch 2.11 and decoded without graphs. Newer torch sets
the state up in whichever thread asks; this does the same on the older ones.
"""

from __future__ import annotations

import threading
from collections import defaultdict


def prepare_thread_for_cuda_graphs() -> None:
    """Give the calling thread its own CUDA-graph tree state (one tree manager per device,
    each behind a lock, as the importing thread has) if it has none yet; idempotent."""
    from torch._inductor import cudagraph_trees

    state = cudagraph_trees.local  # a threading.local: this thread's attributes alone
    if not hasattr(state, "tree_manager_containers"):
        state.tree_manager_containers = {}
        state.tree_manager_locks = defaultdict(threading.Lock)
