"""Prometheus metrics of one server, in their own registry (several apps may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """Requests by status, end-to-end / queue / compute time, batch sizes, queue and
    in-flight; for generation, time to first token, inter-token latency, generated tokens,
    active and waiting sequences, and the share of KV cache slots in use."""

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

        self.first_token_time = Histogram(
            "gpuflow_time_to_first_token_seconds",
            "From a completion request's arrival to its first token", buckets=LATENCY_BUCKETS,
            registry=reg)
        self.inter_token = Histogram("gpuflow_inter_token_latency_seconds",
                                     "Between consecutive tokens of one completion",
                                     buckets=LATENCY_BUCKETS, registry=reg)
        self.generated = Counter("gpuflow_generated_tokens", "Tokens generated", registry=reg)
        self.active_sequences = Gauge("gpuflow_active_sequences",
                                      "Sequences holding a KV cache slot", registry=reg)
        self.waiting_sequences = Gauge("gpuflow_waiting_sequences",
                                       "Completion requests waiting for a slot", registry=reg)
        self.kv_cache_usage = Gauge("gpuflow_kv_cache_usage",
                                    "Share of KV cache slots in use (0-1)", registry=reg)

    def first_token(self, seconds: float) -> None:
        self.first_token_time.observe(seconds)
        self.generated.inc()

    def next_token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)
        self.generated.inc()

    def occupancy(self, active: int, waiting: int, slots: int) -> None:
        self.active_sequences.set(active)
        self.waiting_sequences.set(waiting)
        self.kv_cache_usage.set(active / slots if slots else 0.0)

    def batch_formed(self, rows: int) -> None:
        self.batch_size.observe(rows)

    def queue_changed(self, depth: int) -> None:
        self.queue_depth.set(depth)
