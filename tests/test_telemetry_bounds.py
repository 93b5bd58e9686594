"""Label values that come from outside (handlers, remote workers) cannot grow the metrics without bound."""

from __future__ import annotations

from bridge.telemetry.core import MAX_ERROR_TYPES, Metrics


def test_error_type_labels_are_bounded_per_queue() -> None:
    metrics = Metrics()
    for n in range(MAX_ERROR_TYPES + 500):
        metrics.dead_of("q", f"worker.Random{n}")
    metrics.dead_of("q", "worker.Random3")  # one already seen keeps its own label
    samples = [s for m in metrics.registry.collect() if m.name == "rdq_dead" for s in m.samples
               if s.name == "rdq_dead_total"]
    types = {s.labels["error_type"] for s in samples}
    assert len(types) == MAX_ERROR_TYPES + 1 and "other" in types
    other = next(s.value for s in samples if s.labels["error_type"] == "other")
    assert other == 500
    assert next(s.value for s in samples if s.labels["error_type"] == "worker.Random3") == 2


def test_batched_attempt_metrics_scrape_as_prometheus_counter_and_histogram_would() -> None:
    """AttemptMetrics counts a batch under one lock; its scrape must read exactly as prometheus_client's own
    Counter and Histogram fed the same attempts one by one."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from bridge.model import Outcome
    from bridge.telemetry.core import _DURATION_BUCKETS, AttemptMetrics

    attempts = [(Outcome.SUCCESS, 0.0004), (Outcome.SUCCESS, 0.001), (Outcome.RETRYABLE_FAILURE, 0.3),
                (Outcome.SUCCESS, 7.0), (Outcome.PERMANENT_FAILURE, 1000.0), (Outcome.SUCCESS, 0.005)]
    reference = CollectorRegistry()
    counter = Counter("rdq_attempts", "Handler attempts by outcome (first deliveries included)",
                      ["queue", "outcome"], registry=reference)
    histogram = Histogram("rdq_handler_duration_seconds", "Handler run time", ["queue"],
                          buckets=_DURATION_BUCKETS, registry=reference)
    for queue in ("a", "b"):
        for outcome, seconds in attempts:
            counter.labels(queue, outcome.value).inc()
            histogram.labels(queue).observe(seconds)
    counter.labels("a", "LEASE_EXPIRED").inc(2)

    batched = CollectorRegistry()
    metrics = AttemptMetrics(batched, _DURATION_BUCKETS)
    metrics.add("a", attempts[:2])
    metrics.add("a", attempts[2:])
    metrics.add_many("b", [outcome for outcome, _ in attempts], [seconds for _, seconds in attempts])  # a lane's
    metrics.count("a", "LEASE_EXPIRED", 2)

    def samples(registry: CollectorRegistry) -> set[str]:
        return {line for line in generate_latest(registry).decode().splitlines()
                if not line.startswith("#") and "_created" not in line}

    assert samples(batched) == samples(reference)
