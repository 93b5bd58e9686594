"""Label values that come from outside (handlers, remote workers) cannot grow the metrics without bound."""

from __future__ import annotations

from bridge.telemetry import MAX_ERROR_TYPES, Metrics


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
