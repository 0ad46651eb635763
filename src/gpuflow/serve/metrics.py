"""Prometheus metrics of one server, in their own registry (several apps may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """Requests by status, end-to-end / queue / compute time, batch sizes, queue and in-flight."""

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

    def batch_formed(self, rows: int) -> None:
        self.batch_size.observe(rows)

    def queue_changed(self, depth: int) -> None:
        self.queue_depth.set(depth)
