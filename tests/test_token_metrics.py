"""The streamed tokens' metrics, counted by gpuflow's own collector, read exactly as
prometheus_client's own histograms and counter would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gpuflow.serve.metrics import LATENCY_BUCKETS
from gpuflow.serve.token_metrics import TokenMetrics

# Bucket edges included: an observation equal to a bound counts in that bound's bucket.
FIRST = (0.0004, 0.001, 0.003, 0.01)
NEXT = (0.0005, 0.0025, 0.2, 7.5, 20.0, 0.0)


def exposition(registry: CollectorRegistry) -> list[str]:
    """The text format, less the ``_created`` timestamps ours leaves out."""
    return [line for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line]


def test_the_exposition_is_prometheus_clients_own() -> None:
    ours = CollectorRegistry()
    tokens = TokenMetrics(ours, LATENCY_BUCKETS)
    theirs = CollectorRegistry()
    first = Histogram("gpuflow_time_to_first_token_seconds",
                      "From a completion request's arrival to its first token",
                      buckets=LATENCY_BUCKETS, registry=theirs)
    between = Histogram("gpuflow_inter_token_latency_seconds",
                        "Between consecutive tokens of one completion",
                        buckets=LATENCY_BUCKETS, registry=theirs)
    generated = Counter("gpuflow_generated_tokens", "Tokens generated", registry=theirs)
    for seconds in FIRST:
        tokens.first_token(seconds)
        first.observe(seconds)
        generated.inc()
    for seconds in NEXT:
        tokens.next_token(seconds)
        between.observe(seconds)
        generated.inc()
    assert exposition(ours) == exposition(theirs)
    assert f"gpuflow_generated_tokens_total {float(len(FIRST) + len(NEXT))}" in exposition(ours)
