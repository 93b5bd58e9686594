"""Label values that come from outside (handlers, remote workers) cannot grow the metrics without bound."""

from __future__ import annotations

import bisect

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from bridge.model import Outcome
from bridge.telemetry.core import DURATION_BUCKETS, MAX_ERROR_TYPES, AttemptMetrics, Metrics, buckets_of


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
    attempts = [(Outcome.SUCCESS, 0.0004), (Outcome.SUCCESS, 0.001), (Outcome.RETRYABLE_FAILURE, 0.3),
                (Outcome.SUCCESS, 7.0), (Outcome.PERMANENT_FAILURE, 1000.0), (Outcome.SUCCESS, 0.005)]
    reference = CollectorRegistry()
    counter = Counter("rdq_attempts", "Handler attempts by outcome (first deliveries included)",
                      ["queue", "outcome"], registry=reference)
    histogram = Histogram("rdq_handler_duration_seconds", "Handler run time", ["queue"],
                          buckets=DURATION_BUCKETS, registry=reference)
    for queue in ("a", "b"):
        for outcome, seconds in attempts:
            counter.labels(queue, outcome.value).inc()
            histogram.labels(queue).observe(seconds)
    counter.labels("a", "LEASE_EXPIRED").inc(2)

    batched = CollectorRegistry()
    metrics = AttemptMetrics(batched, DURATION_BUCKETS)
    metrics.add("a", attempts[:2])
    metrics.add("a", attempts[2:])
    metrics.add_many("b", [outcome for outcome, _ in attempts], [seconds for _, seconds in attempts])  # a lane's
    metrics.count("a", "LEASE_EXPIRED", 2)

    def samples(registry: CollectorRegistry) -> set[str]:
        return {line for line in generate_latest(registry).decode().splitlines()
                if not line.startswith("#") and "_created" not in line}

    assert samples(batched) == samples(reference)


_SECONDS = st.one_of(st.sampled_from([0.0, *DURATION_BUCKETS]), st.floats(0, 20, allow_nan=False),
                     st.sampled_from([b * (1 + 1e-12) for b in DURATION_BUCKETS]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Outcome)), _SECONDS), max_size=60),
       st.lists(_SECONDS, max_size=60))
def test_a_batch_with_its_successes_counted_scrapes_as_one_observation_at_a_time_would(
        ran: list[tuple[Outcome, float]], ok: list[float]) -> None:
    """A lane's batch reaches AttemptMetrics as the outcomes of the records that did not simply succeed, and a
    count of successes whose seconds follow (`add_many(..., successes=n)`); its buckets are found by sorting the
    batch once. Whatever the values — on a bucket's bound, a hair above it, past the last — the scrape must read
    as prometheus_client's Histogram and Counter fed each attempt on its own."""
    reference = CollectorRegistry()
    counter = Counter("rdq_attempts", "Handler attempts by outcome (first deliveries included)",
                      ["queue", "outcome"], registry=reference)
    histogram = Histogram("rdq_handler_duration_seconds", "Handler run time", ["queue"],
                          buckets=DURATION_BUCKETS, registry=reference)
    for outcome, seconds in [*ran, *((Outcome.SUCCESS, s) for s in ok)]:
        counter.labels("q", outcome.value).inc()
        histogram.labels("q").observe(seconds)
    batched = CollectorRegistry()
    AttemptMetrics(batched, DURATION_BUCKETS).add_many("q", [o for o, _ in ran], [s for _, s in ran] + ok, len(ok))
    assert _samples(batched) == _samples(reference)


def _samples(registry: CollectorRegistry) -> set[str]:
    return {line for line in generate_latest(registry).decode().splitlines()
            if not line.startswith("#") and "_created" not in line and "_sum" not in line}


@given(st.lists(st.floats(0, 20, allow_nan=False)), st.lists(st.floats(0, 20, allow_nan=False), max_size=20))
def test_buckets_of_puts_each_value_in_the_first_bucket_whose_bound_it_does_not_pass(
        seconds: list[float], bounds: list[float]) -> None:
    bounds = sorted(set(bounds))
    expected: dict[int, int] = {}
    for value in seconds:
        slot = bisect.bisect_left(bounds, value)
        expected[slot] = expected.get(slot, 0) + 1
    assert dict(buckets_of(bounds, seconds)) == expected
