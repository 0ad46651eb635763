"""What a run measures: step time, FLOPs, peak memory and the collective waits compute did not hide.

The lowest layer beside ``errors`` and ``devices``: ``train``, ``planner``, ``parallel`` and
``report`` import it, and it imports none of them.
"""
