"""The metrics a streamed token moves: time to first token, inter-token latency and
generated tokens, exposed as Prometheus histograms and a counter by a collector of our own.

They change once per token, from the event loop alone (``requests.Generation``), where a
``prometheus_client`` Histogram's ``observe`` and a Counter's ``inc`` took ~1.5 us between
them (a lock per value, a Python loop over the buckets): 6% of the server's host time per
token at 256 streams. Here a token costs one ``bisect`` and two additions; the exposition
is the same (``_bucket``, ``_sum``, ``_count``; ``_total``), made at scrape time. A scrape
from another thread may see a token in the count and not yet in the sum, as
``prometheus_client``'s own histograms may."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class _Histogram:
    """Observations counted per bucket (``le`` its upper bound, the last ``+Inf``)."""

    def __init__(self, name: str, documentation: str, bounds: Sequence[float]) -> None:
        self.name, self.documentation, self.bounds = name, documentation, tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        cumulative = list(accumulate(self.counts))
        labels = [*map(floatToGoString, self.bounds), "+Inf"]
        return HistogramMetricFamily(self.name, self.documentation,
                                     buckets=list(zip(labels, cumulative, strict=True)),
                                     sum_value=self.sum)


class TokenMetrics:
    """Time to first token, inter-token latency (histograms over ``bounds``) and tokens
    generated (a counter), registered in ``registry``; call from one thread."""

    def __init__(self, registry: CollectorRegistry, bounds: Sequence[float]) -> None:
        self.first = _Histogram("gpuflow_time_to_first_token_seconds",
                                "From a completion request's arrival to its first token",
                                bounds)
        self.next = _Histogram("gpuflow_inter_token_latency_seconds",
                               "Between consecutive tokens of one completion", bounds)
        self.generated = 0
        registry.register(self)

    def first_token(self, seconds: float) -> None:
        self.first.observe(seconds)
        self.generated += 1

    def next_token(self, seconds: float) -> None:
        self.next.observe(seconds)
        self.generated += 1

    def collect(self) -> Iterator[Metric]:
        yield self.first.family()
        yield self.next.family()
        yield CounterMetricFamily("gpuflow_generated_tokens", "Tokens generated",
                                  value=self.generated)
