"""Prometheus metrics of one server, in their own registry (several apps may share a process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpuflow.serve.token_metrics import TokenMetrics

if TYPE_CHECKING:
    from gpuflow.serve.generate.messages import Occupancy, StepTiming

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Engine steps: from a CUDA graph's replay (well under a millisecond) to a long prefill.
STEP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
# A step's grammar masks: ~0.1 ms a row for 49k tokens, to a long grammar's slow step.
MASK_BUCKETS = (0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)


class ServeMetrics:
    """Requests by status, end-to-end / queue / compute time, batch sizes, queue and
    in-flight; for generation, time to first token, inter-token latency, generated tokens,
    running and waiting sequences, KV cache blocks in use, preemptions, the prefix
    cache's lookups, hits and hit rate, speculative decoding's drafted and accepted
    tokens and acceptance rate, and the engine's step and forward times with the rows and
    tokens its steps computed and its grammars' mask times (structured outputs)."""

    def __init__(self, max_batch_size: int) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("gpuflow_requests", "Prediction requests by HTTP status",
                                ["status"], registry=reg)
        self.latency = Histogram("gpuflow_request_latency_seconds",
                                 "End-to-end time of a prediction request in the server",
                                 buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_time = Histogram("gpuflow_queue_time_seconds",
                                    "Time a request waited in the queue before its batch ran",
                                    buckets=LATENCY_BUCKETS, registry=reg)
        self.compute_time = Histogram("gpuflow_compute_time_seconds",
                                      "Time the model took for the batch a request ran in",
                                      buckets=LATENCY_BUCKETS, registry=reg)
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, max_batch_size})
        self.batch_size = Histogram("gpuflow_batch_size", "Rows per batch run by the model",
                                    buckets=[s for s in sizes if s <= max_batch_size],
                                    registry=reg)
        self.queue_depth = Gauge("gpuflow_queue_depth", "Requests waiting in the queue",
                                 registry=reg)
        self.in_flight = Gauge("gpuflow_in_flight_requests",
                               "Prediction requests being handled", registry=reg)

        self.tokens = TokenMetrics(reg, LATENCY_BUCKETS)  # TTFT, ITL, generated tokens
        self.active_sequences = Gauge("gpuflow_active_sequences",
                                      "Sequences holding KV cache blocks", registry=reg)
        self.waiting_sequences = Gauge("gpuflow_waiting_sequences",
                                       "Completion requests waiting to start", registry=reg)
        self.kv_cache_usage = Gauge("gpuflow_kv_cache_usage",
                                    "Share of KV cache blocks in use (0-1)", registry=reg)
        self.kv_blocks_used = Gauge("gpuflow_kv_cache_blocks_used",
                                    "KV cache blocks held by sequences", registry=reg)
        self.kv_blocks_total = Gauge("gpuflow_kv_cache_blocks_total",
                                     "KV cache blocks sequences can hold", registry=reg)
        self.preemptions = Counter("gpuflow_preemptions",
                                   "Sequences preempted (blocks freed, recomputed later) "
                                   "when the KV cache ran out", registry=reg)
        self.prefix_queries = Counter("gpuflow_prefix_cache_queries_tokens",
                                      "Prompt tokens looked up in the prefix cache",
                                      registry=reg)
        self.prefix_hits = Counter("gpuflow_prefix_cache_hits_tokens",
                                   "Prompt tokens found in the prefix cache", registry=reg)
        self.prefix_hit_rate = Gauge("gpuflow_prefix_cache_hit_rate",
                                     "Share of looked-up prompt tokens found cached (0-1)",
                                     registry=reg)
        self.drafted = Counter("gpuflow_spec_decode_draft_tokens",
                               "Tokens drafted for speculative decoding (not those after "
                               "their sequence finished)", registry=reg)
        self.accepted = Counter("gpuflow_spec_decode_accepted_tokens",
                                "Drafted tokens the model accepted", registry=reg)
        self.acceptance_rate = Gauge("gpuflow_spec_decode_acceptance_rate",
                                     "Share of drafted tokens accepted (0-1)", registry=reg)
        self._add_step_metrics(reg)
        # Preemptions, prefix queries and hits, drafted and accepted tokens counted so far.
        self._totals = (0, 0, 0, 0, 0)

    def _add_step_metrics(self, reg: CollectorRegistry) -> None:
        """The generation engine's steps: times, rows and tokens, graphs, grammar masks."""
        self.step_time = Histogram("gpuflow_engine_step_seconds",
                                   "One generation engine step: forward, sampling and events",
                                   buckets=STEP_BUCKETS, registry=reg)
        self.forward_time = Histogram("gpuflow_engine_forward_seconds",
                                      "The model runner's call in one generation engine "
                                      "step (on a GPU, launching its work)",
                                      buckets=STEP_BUCKETS, registry=reg)
        self.step_rows = Counter("gpuflow_engine_step_rows",
                                 "Sequences computed, summed over engine steps", registry=reg)
        self.step_tokens = Counter("gpuflow_engine_step_tokens",
                                   "Tokens computed (prompt and generated, drafts not "
                                   "counted), summed over engine steps", registry=reg)
        self.graphed_steps = Counter("gpuflow_engine_graphed_steps",
                                     "Engine steps whose forward replayed a CUDA graph",
                                     registry=reg)
        self.graphed_tokens = Counter("gpuflow_engine_graphed_tokens",
                                      "Tokens computed by steps that replayed a CUDA graph",
                                      registry=reg)
        self.mask_time = Histogram("gpuflow_engine_grammar_mask_seconds",
                                   "Token masks of constrained rows (structured outputs) in "
                                   "one engine step that had any", buckets=MASK_BUCKETS,
                                   registry=reg)

    def first_token(self, seconds: float) -> None:
        self.tokens.first_token(seconds)

    def next_token(self, seconds: float) -> None:
        self.tokens.next_token(seconds)

    def occupancy(self, now: Occupancy) -> None:
        """The generation engine after a step; its totals turn into counter increments."""
        self.active_sequences.set(now.running)
        self.waiting_sequences.set(now.waiting)
        self.kv_blocks_used.set(now.blocks_used)
        self.kv_blocks_total.set(now.blocks_total)
        self.kv_cache_usage.set(now.blocks_used / now.blocks_total if now.blocks_total else 0.0)
        totals = (now.preemptions, now.prefix_queries, now.prefix_hits, now.drafted,
                  now.accepted)
        counters = (self.preemptions, self.prefix_queries, self.prefix_hits, self.drafted,
                    self.accepted)
        for counter, total, counted in zip(counters, totals, self._totals, strict=True):
            counter.inc(total - counted)
        self._totals = totals
        if now.prefix_queries:
            self.prefix_hit_rate.set(now.prefix_hits / now.prefix_queries)
        if now.drafted:
            self.acceptance_rate.set(now.accepted / now.drafted)

    def step(self, timing: StepTiming) -> None:
        """One generation engine step: its time, its forward's, its grammars' masks', its
        rows and tokens."""
        self.step_time.observe(timing.step_s)
        self.forward_time.observe(timing.forward_s)
        self.step_rows.inc(timing.rows)
        self.step_tokens.inc(timing.tokens)
        if timing.mask_s:
            self.mask_time.observe(timing.mask_s)
        if timing.graphed:
            self.graphed_steps.inc()
            self.graphed_tokens.inc(timing.tokens)

    def batch_formed(self, rows: int) -> None:
        self.batch_size.observe(rows)

    def queue_changed(self, depth: int) -> None:
        self.queue_depth.set(depth)
