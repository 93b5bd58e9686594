"""Observability (SPEC §9): traces that follow a record's whole life, Prometheus metrics.

Traces use the OpenTelemetry API with a tracer provider of our own (configured from `telemetry.tracing`:
none | console | otlp). Every attempt — inline, hours later, after a restart — is a child of the source record's
`traceparent`, so one trace shows the record's whole life; the DLQ record carries it; a redrive links back.
With tracing off, the per-record path does no tracing work at all (one attribute check).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import random
import threading
from collections import Counter as Tally  # prometheus_client's Counter is the metric
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from bridge.config import TelemetryConfig
from bridge.model import Outcome
from bridge.records import TRACEPARENT, SourceRecord, valid_traceparent

_PROPAGATOR = TraceContextTextMapPropagator()
# A `_created` series beside every counter and histogram doubles what `/metrics` carries for nothing Prometheus
# uses (it reads resets from the values); the bridge is its own process, so the switch is process-wide.
disable_created_metrics()  # type: ignore[no-untyped-call]
MAX_ERROR_TYPES = 50  # distinct `error_type` label values per queue; more count as "other"
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_TIME_TO_SUCCESS_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400)


class Metrics:
    """The bridge's Prometheus metrics, on a registry of its own (served at /metrics)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.records = Counter("rdq_records_consumed", "Source records consumed", ["queue"], registry=r)
        self.tasks_created = Counter("rdq_tasks_created", "Tasks created from failed first deliveries",
                                     ["queue", "status"], registry=r)
        self.attempts = AttemptMetrics(r, DURATION_BUCKETS)
        self.dead = Counter("rdq_dead", "Tasks dead-lettered, by error type", ["queue", "error_type"], registry=r)
        self.redrives = Counter("rdq_redrives", "Tasks redriven", ["queue"], registry=r)
        self.dlq_published = Counter("rdq_dlq_published", "DLQ records acknowledged by the broker", ["queue"],
                                     registry=r)
        self.open_tasks = Gauge("rdq_open_tasks", "Open tasks (PENDING, IN_FLIGHT, PARKED) by queue",
                                ["queue", "status"], registry=r)
        self.parked_oldest = Gauge("rdq_parked_oldest_seconds", "Age of the queue's oldest parked task (ordering: "
                                   "key): how long its key has been held back", ["queue"], registry=r)
        self.time_to_success = Histogram("rdq_time_to_success_seconds",
                                         "From a task's creation (first failure) to its success",
                                         ["queue"], buckets=_TIME_TO_SUCCESS_BUCKETS, registry=r)
        self.dlq_stuck = Gauge("rdq_dlq_stuck", "DEAD tasks whose last DLQ publish failed (each waits for its own "
                               "retry; the others are published)", ["queue"], registry=r)
        self.late_successes = Counter("rdq_late_successes", "Successes from a stale lease holder, by whether the "
                                      "store accepted them (SPEC §4.5)", ["queue", "accepted"], registry=r)
        self.threads_stuck = Gauge("rdq_handler_threads_stuck", "Sync handler threads still running a call that "
                                   "was abandoned (lease lost, silent, timed out)", ["queue"], registry=r)
        self.ready = Gauge("rdq_ready", "1 when /readyz is 200: broker reachable, store writable, group joined, "
                           "nothing restoring", registry=r)
        # The changelog (SPEC §10), per source partition ("topic/partition").
        self.changelog_unlogged = Gauge("rdq_changelog_lag", "Task transitions stored here but not yet acknowledged "
                                        "by the changelog", registry=r)
        self.changelog_commits = Counter("rdq_changelog_transactions", "Changelog transactions, by result",
                                         ["result"], registry=r)
        self.changelog_unreadable = Gauge("rdq_changelog_unreadable", "Changelog records this bridge could not "
                                          "read (kept in the store, see `rdq stats`)", ["partition"], registry=r)
        self.changelog_quarantined = Gauge("rdq_changelog_quarantined", "Tasks whose last changelog record this "
                                           "bridge cannot read: held, not run (see `rdq stats`)", ["partition"],
                                           registry=r)
        self.restoring = Gauge("rdq_partition_restoring", "1 while a source partition's tasks are restored from "
                               "its changelog (not consumed meanwhile)", ["partition"], registry=r)
        self.restored_tasks = Gauge("rdq_partition_restored_tasks", "Tasks restored at the last assignment",
                                    ["partition"], registry=r)
        self.restore_seconds = Gauge("rdq_partition_restore_seconds", "Duration of the last restore",
                                     ["partition"], registry=r)
        self.breaker_state = Gauge("rdq_breaker_state", "The queue's circuit breaker: 0 closed, 1 half-open, 2 open",
                                   ["queue"], registry=r)
        self.breaker_transitions = Counter("rdq_breaker_transitions", "Circuit breaker state changes, by the state "
                                           "entered", ["queue", "to"], registry=r)
        self._error_types: dict[str, set[str]] = {}
        # Label children resolved once: the per-record path skips prometheus' label lookup.
        self._record_children: dict[str, Any] = {}

    def attempt(self, queue: str, outcome: Outcome, seconds: float) -> None:
        self.attempts.add(queue, [(outcome, seconds)])

    def dead_of(self, queue: str, error_type: str, n: int = 1) -> None:
        """Count a dead task. Error types come from handlers and remote workers (any string): at most
        MAX_ERROR_TYPES distinct ones per queue become label values, the rest count as `other` (a worker sending
        random types must not grow the metrics without bound)."""
        seen = self._error_types.setdefault(queue, set())
        if error_type not in seen:
            if len(seen) >= MAX_ERROR_TYPES:
                error_type = "other"
            else:
                seen.add(error_type)
        self.dead.labels(queue, error_type[:200]).inc(n)

    def record_seen(self, queue: str) -> None:
        self.records_seen(queue, 1)

    def records_seen(self, queue: str, n: int) -> None:
        child = self._record_children.get(queue)
        if child is None:
            child = self._record_children[queue] = self.records.labels(queue)
        child.inc(n)


def buckets_of(bounds: Sequence[float], seconds: Sequence[float]) -> list[tuple[int, int]]:
    """(bucket, observations) of a batch, a histogram's bucket i holding those <= bounds[i] and above the bound
    before (the last: above every bound). The batch sorted once and each bound found in it by bisection, not
    one bisection a value: a lane's batch of fast successes all fall in the first bucket, found at once."""
    ordered = sorted(seconds)
    if not ordered:
        return []
    n, top, below = len(ordered), ordered[-1], 0
    slots = []
    for i, bound in enumerate(bounds):
        if bound >= top:
            slots.append((i, n - below))
            return slots
        upto = bisect.bisect_right(ordered, bound, below)
        if upto > below:
            slots.append((i, upto - below))
            below = upto
    slots.append((len(bounds), n - below))
    return slots


class AttemptMetrics:
    """`rdq_attempts_total{queue,outcome}` and `rdq_handler_duration_seconds{queue}`, counted a batch at a time.

    prometheus_client's Counter and Histogram take a lock per increment: 4 µs an attempt on this machine, a
    fifth of what the bridge adds to a record on the happy path. This collector takes one lock per batch of a
    lane's results (and per scheduler attempt) and builds the two families when scraped."""

    def __init__(self, registry: CollectorRegistry, buckets: tuple[float, ...]) -> None:
        self._bounds = list(buckets)
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], float] = {}
        # Per queue: observations per bucket (not cumulative; the last is +Inf), and their sum.
        self._buckets: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}
        registry.register(self)

    def add(self, queue: str, attempts: list[tuple[Outcome, float]]) -> None:
        """Attempts that ran a handler: outcome and seconds each."""
        self.add_many(queue, [outcome for outcome, _ in attempts], [seconds for _, seconds in attempts])

    def add_many(self, queue: str, outcomes: Sequence[Outcome], seconds: Sequence[float], successes: int = 0) -> None:
        """A batch of attempts that ran a handler: `outcomes` those of the first seconds, and `successes` more that
        succeeded, their seconds the rest (a lane's chunks: no outcome a success). Tallied by C loops, not a
        Python loop a record."""
        if not seconds:
            return
        slots = buckets_of(self._bounds, seconds)
        total = sum(seconds)
        outcomes_seen = Tally(outcomes)
        if successes:
            outcomes_seen[Outcome.SUCCESS] += successes
        with self._lock:
            buckets = self._buckets.get(queue)
            if buckets is None:
                buckets = self._buckets[queue] = [0] * (len(self._bounds) + 1)
            for slot, n in slots:
                buckets[slot] += n
            self._sums[queue] = self._sums.get(queue, 0.0) + total
            for outcome, n in outcomes_seen.items():
                key = (queue, outcome.value)
                self._counts[key] = self._counts.get(key, 0) + n

    def count(self, queue: str, outcome: str, n: int = 1) -> None:
        """Attempts ended without a handler's duration (a lapsed lease found by the sweep)."""
        with self._lock:
            self._counts[(queue, outcome)] = self._counts.get((queue, outcome), 0) + n

    def total(self, queue: str, outcome: Outcome) -> float:
        """Attempts of `queue` that ended so."""
        with self._lock:
            return self._counts.get((queue, outcome.value), 0)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            counts = dict(self._counts)
            buckets = {q: list(b) for q, b in self._buckets.items()}
            sums = dict(self._sums)
        attempts = CounterMetricFamily("rdq_attempts", "Handler attempts by outcome (first deliveries included)",
                                       labels=["queue", "outcome"])
        for (queue, outcome), n in sorted(counts.items()):
            attempts.add_metric([queue, outcome], n)
        durations = HistogramMetricFamily("rdq_handler_duration_seconds", "Handler run time", labels=["queue"])
        for queue, observed in sorted(buckets.items()):
            cumulative = list(itertools.accumulate(observed))
            bounds = [*(floatToGoString(b) for b in self._bounds), "+Inf"]  # type: ignore[no-untyped-call]
            durations.add_metric([queue], list(zip(bounds, cumulative, strict=True)), sums[queue])
        yield attempts
        yield durations


def _exporter(config: TelemetryConfig) -> SpanExporter | None:
    if config.tracing == "console":
        return ConsoleSpanExporter()
    if config.tracing == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=config.otlp_endpoint) if config.otlp_endpoint else OTLPSpanExporter()
    return None


def sampler(ratio: float) -> ParentBased:
    """Parent-based: a remote parent's sampled flag decides; a root trace is sampled with probability `ratio`
    (the new traceparent a root record gets carries that decision, see `Telemetry.sample`)."""
    return ParentBased(TraceIdRatioBased(ratio))


def context_of(headers: Mapping[str, str]) -> Context:
    return _PROPAGATOR.extract({k: v for k, v in headers.items() if k in ("traceparent", "tracestate")})


class Telemetry:
    def __init__(self, config: TelemetryConfig | None = None, provider: TracerProvider | None = None,
                 metrics: Metrics | None = None, group_id: str = "", instance_id: str = "") -> None:
        config = config or TelemetryConfig()
        self.metrics = metrics or Metrics()
        self.group_id = group_id
        self.provider = provider
        self.sample_ratio = config.sample_ratio
        if self.provider is None:
            exporter = _exporter(config)
            if exporter is not None:
                resource = Resource.create({"service.name": "rdq-bridge", "service.instance.id": instance_id})
                self.provider = TracerProvider(resource=resource, sampler=sampler(config.sample_ratio))
                self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracing = self.provider is not None
        self._tracer = self.provider.get_tracer("rdq-bridge") if self.provider else None

    def sample(self, record: SourceRecord) -> bool:
        """Is this record traced? The decision the parent-based sampler will make, made before any span or
        attribute is built: the producer's flag when the record carries a traceparent, else `sample_ratio`."""
        if self._tracer is None:
            return False
        traceparent = record.header_text(TRACEPARENT)
        if traceparent is not None and valid_traceparent(traceparent):
            return traceparent.strip().endswith(("1", "3", "5", "7", "9", "b", "d", "f"))  # flags & 0x01
        ratio = self.sample_ratio
        return ratio >= 1.0 or (ratio > 0.0 and random.random() < ratio)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()

    # ---- spans (each a no-op context when tracing is off) -------------------------------------------------

    @contextlib.contextmanager
    def consume_span(self, record: SourceRecord, queue: str, headers: Mapping[str, str]) -> Iterator[Any]:
        if self._tracer is None:
            yield None
            return
        attributes: dict[str, Any] = {
            "messaging.system": "kafka", "messaging.operation.type": "process", "messaging.operation.name": "process",
            "messaging.destination.name": record.topic, "messaging.destination.partition.id": str(record.partition),
            "messaging.kafka.offset": record.offset, "messaging.consumer.group.name": self.group_id,
            "rdq.queue": queue,
        }  # fmt: skip
        if record.key is not None:
            attributes["messaging.kafka.message.key"] = record.key.decode("utf-8", "replace")
        with self._tracer.start_as_current_span(f"process {record.topic}", context=context_of(headers),
                                                kind=SpanKind.CONSUMER, attributes=attributes) as span:
            yield span

    @contextlib.contextmanager
    def attempt_span(self, task: Any, queue: str, attempt: int, headers: Mapping[str, str],
                     inline: bool = False) -> Iterator[Any]:
        """One handler attempt. Inline (first delivery): under the consume span; a retry: under the source's,
        named by `task.id`. A first delivery's task id is set by `end_attempt` when it failed (a success has no
        task: making its id would cost every record)."""
        if self._tracer is None:
            yield None
            return
        parent = None if inline else context_of(headers)
        attributes: dict[str, Any] = {"rdq.queue": queue, "rdq.attempt": attempt,
                                      "rdq.source": headers.get("rdq.source", "")}
        if not inline:  # a first delivery has a task only if it fails: `end_attempt` names it then
            attributes["rdq.task.id"] = getattr(task, "id", "")
        with self._tracer.start_as_current_span(f"attempt {queue}", context=parent, kind=SpanKind.INTERNAL,
                                                attributes=attributes, record_exception=False,
                                                set_status_on_exception=False) as span:
            yield span

    @staticmethod
    def end_attempt(span: Any, outcome: Outcome, error_type: str | None = None, task_id: str | None = None) -> None:
        if span is None:
            return
        if task_id is not None:
            span.set_attribute("rdq.task.id", task_id)
        span.set_attribute("rdq.outcome", outcome.value)
        if outcome != Outcome.SUCCESS:
            span.set_attribute("error.type", error_type or outcome.value)
            span.set_status(Status(StatusCode.ERROR, error_type or outcome.value))

    @contextlib.contextmanager
    def publish_span(self, task_id: str, queue: str, topic: str, headers: Mapping[str, str]) -> Iterator[Any]:
        if self._tracer is None:
            yield None
            return
        attributes: dict[str, Any] = {"messaging.system": "kafka", "messaging.operation.type": "send",
                      "messaging.operation.name": "publish", "messaging.destination.name": topic,
                      "rdq.task.id": task_id, "rdq.queue": queue}
        with self._tracer.start_as_current_span(f"publish {topic}", context=context_of(headers),
                                                kind=SpanKind.PRODUCER, attributes=attributes) as span:
            yield span

    @staticmethod
    def traceparent_of(span: Any, fallback: str | None) -> str | None:
        """The traceparent a DLQ record carries: the publish span's (same trace) or, untraced, the source's."""
        if span is None:
            return fallback
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent", fallback)

    def redrive_span(self, task_id: str, queue: str, headers: Mapping[str, str], by: str | None) -> None:
        """A redrive: its own short span linking back to the record's trace."""
        if self._tracer is None:
            return
        source = trace.get_current_span(context_of(headers)).get_span_context()
        links = [Link(source)] if source.is_valid else []
        span = self._tracer.start_span("redrive", kind=SpanKind.INTERNAL, links=links,
                                       attributes={"rdq.task.id": task_id, "rdq.queue": queue,
                                                   "rdq.redrive.by": by or ""})
        span.end()
