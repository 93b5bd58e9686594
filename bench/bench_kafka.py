"""Kafka-path benchmarks (issue 8), each against a baseline measured in the same run on the same broker.

    python -m bench.bench_kafka happy   [--n 100000]   # bridge + ok handler vs a bare consume/commit loop
                                                     # (sync, async, traced, traced with a 1% sampler)
    python -m bench.bench_kafka bookkeeping [--n 100000]  # the per-record work inline, and the floor of any design
    python -m bench.bench_kafka failure [--n 20000]    # every first attempt fails → durable tasks, vs SQLite
    python -m bench.bench_kafka dlq     [--n 5000]     # DEAD tasks (5 attempts) published, vs a bare producer
    python -m bench.bench_kafka e2e     [--n 2000]     # first failure → successful retry, zero backoff
    python -m bench.bench_kafka all     # every one of the above

A broker: KAFKA_BOOTSTRAP_SERVERS, or a local one started here (localkafka). The retry path and the scale
figures are `python -m bench.bench_engine retry|scale`.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import handlers  # noqa: F401 - the example handlers
from bench.bench_engine import new_failures, plain_inserts
from bench.common import NO_BREAKER, NO_BREAKER_NOTE, BenchTimeout, percentile, record, rss_mib
from bridge.clock import SystemClock
from bridge.config import BridgeConfig, TelemetryConfig, parse_config
from bridge.dlq.envelope import build_record
from bridge.dlq.publisher import DlqPublisher
from bridge.handler_api import HandlerContext
from bridge.kafka_clients import FETCH_QUEUE_BACKOFF_MS, ensure_topics, make_admin, make_dlq_producer
from bridge.live_config import LiveConfig
from bridge.memory import tune_gc
from bridge.model import Attempt, ErrorInfo, NewTask, Outcome, Status, new_task_id
from bridge.records import SourceRecord, TaskHeaders
from bridge.registry import REGISTRY, Registry
from bridge.service import Bridge, open_bridge
from bridge.source.first_delivery import FirstDelivery
from bridge.source.offsets import PartitionTracker
from bridge.store.queries import q
from bridge.store.tasks import Store
from bridge.telemetry.core import DURATION_BUCKETS, Telemetry, sampler
from localkafka import LocalBroker

PAYLOAD = b'{"fail": 0, "pad": "' + b"x" * 1000 + b'"}'  # ~1 KB
PARTITIONS = 6


@contextlib.contextmanager
def broker() -> Iterator[str]:
    configured = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if configured:
        yield configured
        return
    with LocalBroker() as local:
        yield local.bootstrap_servers


def bench_config(bootstrap: str, tmp: Path, queue: dict[str, Any], **extra: Any) -> BridgeConfig:
    unique = uuid.uuid4().hex[:8]
    tree: dict[str, Any] = {
        "kafka": {"bootstrap_servers": bootstrap, "group_id": f"bench-{unique}", "topic_partitions": PARTITIONS},
        "store": {"path": str(tmp / f"{unique}.db")},
        "queues": {"q": {"sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}", **queue}},
        "engine": {"handler_modules": ["handlers"], "grace_period": "2s"},
    }
    tree.update(extra)
    return parse_config(tree)


def produce(bootstrap: str, topic: str, n: int, payload: bytes = PAYLOAD, keys: int | None = None) -> None:
    """n records; `keys`: that many distinct keys, in turn (default: every record its own key)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1_000_000})
    for i in range(n):
        while True:
            try:
                producer.produce(topic, value=payload, key=str(i if keys is None else i % keys).encode())
                break
            except BufferError:
                producer.poll(0.1)
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(120) == 0


class DropExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def run_bridge_until(config: BridgeConfig, done: Any, registry: Registry | None = None,
                           telemetry: Telemetry | None = None, within: float = 600) -> tuple[float, Bridge]:
    bridge = await open_bridge(config, registry or REGISTRY, instance_id="bench", telemetry=telemetry)
    store = bridge.store
    stop = asyncio.Event()
    began = time.perf_counter()
    runner = asyncio.create_task(bridge.run(stop))
    deadline = time.monotonic() + within
    finished = False
    while not (finished := await done(bridge)) and time.monotonic() < deadline:  # noqa: ASYNC110 - the measure
        await asyncio.sleep(0.02)
    elapsed = time.perf_counter() - began
    stop.set()
    await runner
    await store.close()
    if not finished:
        raise BenchTimeout(f"the bridge did not reach {getattr(done, '__name__', 'its goal')} within {within:.0f} s "
                           f"(records handled: {records_handled(bridge):.0f}; open tasks by status: see its store "
                           f"{config.store.path})")
    return elapsed, bridge


def records_handled(bridge: Bridge) -> float:
    """Records whose handler finished successfully (finished work, as the bare loop counts it: not records
    fetched, which the bridge counts when a record's handling begins)."""
    return sum(s.value for m in bridge.telemetry.metrics.attempts.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels.get("outcome") == "SUCCESS")


# ---- 1. happy path ------------------------------------------------------------------------------------------


class Finished:
    """Counts records whose handler finished and when the first and the n-th did: the rate between them is the
    steady-state rate (startup, group join and restore are reported apart). The bare loop and the bridge run
    the same handler wrapped in the same counter."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._count = itertools.count(1)  # next() on it is atomic in CPython: handler threads may race
        self.first: float | None = None
        self.last: float | None = None

    def __call__(self) -> None:
        i = next(self._count)
        if i == 1:
            self.first = time.perf_counter()
        elif i == self.n:
            self.last = time.perf_counter()

    def rate(self) -> float:
        assert self.first is not None and self.last is not None
        return (self.n - 1) / (self.last - self.first)


def counted_ok(finished: Finished, kind: str = "sync") -> Registry:
    ok = REGISTRY.get("ok")
    assert ok is not None
    registry = Registry()
    if kind == "sync":
        def ok_sync(ctx: HandlerContext) -> None:
            ok.fn(ctx)
            finished()

        registry.register("ok", ok_sync)
    else:
        async def ok_async(ctx: HandlerContext) -> None:
            ok.fn(ctx)  # the same work, on the loop
            finished()

        registry.register("ok", ok_async)
    return registry


def bare_consumer(bootstrap: str, prefix: str, tuned: bool = True) -> Consumer:
    """A plain consumer; `tuned`: with the bridge's fetch.queue.backoff.ms (librdkafka's default of 1 s idles a
    consumer whose prefetch queue filled up for most of each second, which would make the baseline a third as
    fast and flatter the bridge)."""
    return Consumer({"bootstrap.servers": bootstrap, "group.id": f"{prefix}-{uuid.uuid4().hex}",
                     "auto.offset.reset": "earliest", "enable.auto.offset.store": False,
                     "partition.assignment.strategy": "cooperative-sticky",
                     **({"fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS} if tuned else {})})


def bare_loop(bootstrap: str, topic: str, n: int, tuned: bool = True) -> tuple[float, float]:
    """What a user would otherwise run: consume in batches, run the handler, store offsets, auto-commit.
    Returns (steady-state records/s, seconds from subscribe to the n-th record)."""
    ok = REGISTRY.get("ok")
    assert ok is not None
    finished = Finished(n)
    consumer = bare_consumer(bootstrap, "bare", tuned)
    began = time.perf_counter()
    consumer.subscribe([topic])
    seen = 0
    while seen < n:
        messages = consumer.consume(500, 0.5)
        for msg in messages:
            if msg.error() is not None:
                continue
            source = f"kafka://{msg.topic()}/{msg.partition()}/{msg.offset()}"
            ok.fn(HandlerContext("t", "q", 1, 0, msg.value(), "application/json", {"rdq.source": source}))
            finished()
            seen += 1
        if messages:
            _store_last(consumer, messages)
    elapsed = time.perf_counter() - began
    consumer.close()
    return finished.rate(), elapsed


def _store_last(consumer: Consumer, messages: list[Any]) -> None:
    last: dict[tuple[str, int], Any] = {}
    for msg in messages:
        if msg.error() is None:
            last[(msg.topic(), msg.partition())] = msg
    for msg in last.values():
        consumer.store_offsets(message=msg)


def bookkeeping_loop(bootstrap: str, topic: str, n: int, config: BridgeConfig) -> float:
    """The bare loop doing the bridge's per-record work inline, on the one thread: SourceRecord, offset tracker,
    prepare / run_sync / ended, batched attempt metrics, store_offsets. What the lanes' hand-offs between the
    poll thread, the loop and the runner threads add is the bridge's rate minus this one (the next step)."""
    delivery = FirstDelivery(None, LiveConfig(config), REGISTRY, SystemClock(), None, "bench")  # type: ignore[arg-type]
    consumer = bare_consumer(bootstrap, "inline")
    consumer.subscribe([topic])
    trackers: dict[tuple[str, int], PartitionTracker] = {}
    seen, first = 0, 0.0
    while seen < n:
        messages = consumer.consume(500, 0.5)
        results = []
        for fetched in (SourceRecord.from_message(m) for m in messages if m.error() is None):
            tracker = trackers.setdefault((fetched.topic, fetched.partition), PartitionTracker())
            tracker.fetched(fetched.offset)
            prepared = delivery.prepare(fetched, "q")
            assert not isinstance(prepared, NewTask)
            results.append(delivery.run_sync(prepared))
            tracker.done(fetched.offset)
            seen += 1
            first = first or time.perf_counter()
        if results:
            delivery.count("q", results)
            _store_last(consumer, messages)
    rate = (n - 1) / (time.perf_counter() - first)
    consumer.close()
    return rate


def floor_loop(bootstrap: str, topic: str, n: int, records: bool) -> float:
    """The bare loop plus the least any design of the bridge must add a record: its attempt timed and counted into
    the duration histogram's bucket; `records`: also a `SourceRecord` and lazily made task headers, as the
    bridge's handler context carries them. The ceiling of a redesign of the happy path, not a bridge. Written out
    as `bare_loop` is, not sharing its loop through a callable: a call a record would slow the baseline."""
    ok = REGISTRY.get("ok")
    assert ok is not None
    finished = Finished(n)
    consumer = bare_consumer(bootstrap, "floor")
    consumer.subscribe([topic])
    buckets = [0] * (len(DURATION_BUCKETS) + 1)
    seen, clock = 0, time.monotonic
    while seen < n:
        messages = consumer.consume(500, 0.5)
        for msg in messages:
            if msg.error() is not None:
                continue
            began = clock()
            if records:
                fetched = SourceRecord.from_message(msg)
                ctx = HandlerContext(new_task_id, "q", 1, 0, fetched.value, fetched.content_type,
                                     TaskHeaders(fetched, True))
            else:
                source = f"kafka://{msg.topic()}/{msg.partition()}/{msg.offset()}"
                ctx = HandlerContext("t", "q", 1, 0, msg.value() or b"", "application/json", {"rdq.source": source})
            ok.fn(ctx)
            buckets[bisect.bisect_left(DURATION_BUCKETS, clock() - began)] += 1
            finished()
            seen += 1
        if messages:
            _store_last(consumer, messages)
    consumer.close()
    assert sum(buckets) == n
    return finished.rate()


def ok_topic(bootstrap: str, tmp: Path, n: int) -> tuple[BridgeConfig, str]:
    """A config with queue q on the `ok` handler, and its source topic filled with n records."""
    config = bench_config(bootstrap, tmp, {"handler": "ok"})
    topic = config.queues["q"].sources[0]
    ensure_topics(config)
    produce(bootstrap, topic, n)
    return config, topic


async def bench_bookkeeping(bootstrap: str, n: int, runs: int) -> None:
    bares, inline, ratios = [], [], []
    floors: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config, topic = ok_topic(bootstrap, Path(tmp), n)
        for _ in range(runs):
            bare, _ = await asyncio.to_thread(bare_loop, bootstrap, topic, n)
            rate = await asyncio.to_thread(bookkeeping_loop, bootstrap, topic, n, config)
            bares.append(bare)
            inline.append(rate)
            ratios.append(rate / bare)
            for records in (False, True):
                floors[records].append(await asyncio.to_thread(floor_loop, bootstrap, topic, n, records) / bare)
    record("happy path, the bridge's per-record work on one thread (no hand-offs) vs the bare loop", [
        f"records: {n} x 1 KB, {PARTITIONS} partitions; {runs} runs; steady-state rates",
        f"bare confluent-kafka loop: {_spread(bares)} records/s",
        f"the same loop doing the bridge's per-record work inline: {_spread(inline)} records/s; "
        f"ratio min/median/max {_spread(ratios, '.2f')}",
        "the ceiling of any design: the bare loop timing each attempt into the duration histogram, ratio "
        f"min/median/max {_spread(floors[False], '.2f')}; the same with a SourceRecord and lazy task headers a "
        f"record {_spread(floors[True], '.2f')}",
    ])


def traced(sample_ratio: float = 1.0) -> Telemetry:
    """Tracing on: the SDK with the bridge's parent-based sampler and a batch processor whose exporter drops
    the spans (the cost of making spans, not of shipping them)."""
    provider = TracerProvider(sampler=sampler(sample_ratio))
    provider.add_span_processor(BatchSpanProcessor(DropExporter(), max_queue_size=200_000))
    return Telemetry(TelemetryConfig(sample_ratio=sample_ratio), provider=provider)


HAPPY_VARIANTS: dict[str, str] = {
    "sync": "sync ok handler, tracing off (the default)",
    "async": "async ok handler, tracing off",
    "traced": "sync ok handler, tracing on, every record sampled",
    "traced-1%": "sync ok handler, tracing on, parent-based 1% ratio sampler",
}


async def happy_variant(config: BridgeConfig, variant: str, n: int) -> tuple[float, float]:
    """One bridge run over the topic in a fresh group: (steady-state records/s, seconds to the n-th record)."""
    finished = Finished(n)
    registry = counted_ok(finished, "async" if variant == "async" else "sync")
    telemetry = traced(0.01 if variant == "traced-1%" else 1.0) if variant.startswith("traced") else None

    async def all_finished(bridge: Bridge) -> bool:
        return finished.last is not None

    elapsed, _ = await run_bridge_until(regrouped(config, variant), all_finished, registry, telemetry=telemetry)
    return finished.rate(), elapsed


async def bench_happy(bootstrap: str, n: int, runs: int) -> None:
    ratios: dict[str, list[float]] = {v: [] for v in HAPPY_VARIANTS}
    rates: dict[str, list[float]] = {v: [] for v in ["bare", "untuned", *HAPPY_VARIANTS]}
    walls: dict[str, list[float]] = {v: [] for v in ["bare", "untuned", *HAPPY_VARIANTS]}
    rss: list[float] = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config, topic = ok_topic(bootstrap, Path(tmp), n)
        for run in range(runs):
            untuned, wall = await asyncio.to_thread(bare_loop, bootstrap, topic, n, False)
            rates["untuned"].append(untuned)
            walls["untuned"].append(wall)
            bare, wall = await asyncio.to_thread(bare_loop, bootstrap, topic, n)
            rates["bare"].append(bare)
            walls["bare"].append(wall)
            for variant in HAPPY_VARIANTS:
                rate, wall = await happy_variant(regrouped(config, f"r{run}"), variant, n)
                rates[variant].append(rate)
                walls[variant].append(wall)
                ratios[variant].append(rate / bare)
            rss.append(rss_mib())
    goals = {"sync": ">= 0.8", "async": ">= 0.9", "traced": ">= 0.5", "traced-1%": ">= 0.75"}
    lines = [f"records: {n} x 1 KB, {PARTITIONS} partitions, one broker on this machine; {runs} runs, each: the "
             "bare loop, then the bridge (production defaults, changelog on) in a fresh group per variant",
             "rate: records whose handler finished, between the first and the n-th (steady state); wall: from the "
             "start (subscribe / bridge.run) to the n-th, startup and group join included",
             f"bare loop at librdkafka's defaults (fetch.queue.backoff.ms 1000; not the baseline): "
             f"{_spread(rates['untuned'])} records/s, wall {_spread(walls['untuned'], '.1f')} s",
             f"bare confluent-kafka loop (batch consume, handler inline, store_offsets; the bridge's "
             f"fetch.queue.backoff.ms {FETCH_QUEUE_BACKOFF_MS}): {_spread(rates['bare'])} "
             f"records/s, wall {_spread(walls['bare'], '.1f')} s"]
    for variant, label in HAPPY_VARIANTS.items():
        lines.append(f"bridge, {label}: {_spread(rates[variant])} records/s, wall {_spread(walls[variant], '.1f')} s; "
                     f"ratio min/median/max {_spread(ratios[variant], '.2f')}  (goal {goals[variant]})")
    lines.append(f"RSS of the bench process after each run: {', '.join(f'{r:.0f}' for r in rss)} MiB")
    record("happy path: bridge (ok handler) vs a bare consume/commit loop", lines)


async def bench_ordering(bootstrap: str, n: int, runs: int, keys: int = 1000) -> None:
    """The happy path (sync ok handler, nothing fails) with `ordering: key` against `ordering: none`, in the same
    run, on records of `keys` distinct keys (so records of a key do wait for each other)."""
    rates: dict[str, list[float]] = {"none": [], "key": []}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config = bench_config(bootstrap, Path(tmp), {"handler": "ok"})
        topic = config.queues["q"].sources[0]
        ensure_topics(config)
        produce(bootstrap, topic, n, keys=keys)
        for run in range(runs):
            order = ["none", "key"] if run % 2 == 0 else ["key", "none"]  # neither always goes first
            for ordering in order:
                queue = config.queues["q"].model_copy(update={"ordering": ordering})
                variant = config.model_copy(update={"queues": {"q": queue}})
                rate, _ = await happy_variant(regrouped(variant, f"o{run}-{ordering}"), "sync", n)
                rates[ordering].append(rate)
            ratios.append(rates["key"][-1] / rates["none"][-1])
    record("per-key ordering overhead on the happy path (ordering: key vs none)", [
        f"records: {n} x 1 KB, {keys} distinct keys in turn, {PARTITIONS} partitions; {runs} runs, each: the bridge "
        "(production defaults, changelog on, sync ok handler, nothing fails) with ordering none and key, in a fresh "
        "group each, alternating which goes first",
        f"ordering: none {_spread(rates['none'])} records/s; ordering: key {_spread(rates['key'])} records/s",
        f"ratio key/none min/median/max {_spread(ratios, '.2f')}  (goal >= 0.9)",
    ])


def _spread(values: list[float], fmt: str = ".0f") -> str:
    """min/median/max of a few runs."""
    ordered = sorted(values)
    return "/".join(format(v, fmt) for v in (ordered[0], statistics.median(ordered), ordered[-1]))


def regrouped(config: BridgeConfig, suffix: str, **kafka: Any) -> BridgeConfig:
    """The same topic for another run: a fresh consumer group (reads it all again) and store."""
    path = config.store.path.with_name(f"{suffix}-{config.store.path.name}")
    return config.model_copy(update={
        "kafka": config.kafka.model_copy(update={"group_id": f"{config.kafka.group_id}-{suffix}", **kafka}),
        "store": config.store.model_copy(update={"path": path})})


# ---- 2. failure path ----------------------------------------------------------------------------------------


@dataclass
class FailureRun:
    stored: float  # steady-state tasks/s stored in SQLite: from the first task stored to the n-th
    logged: float  # the same, to the moment the n-th is in the changelog too (= stored with the changelog off)
    config: BridgeConfig
    bridge: Bridge
    shares: dict[str, float]  # the changelog writer's busy share of the steady phase, by step
    helper_rss: float  # MiB: the changelog's outbox process at the end of the steady phase (0: none ran)


async def failure_run(bootstrap: str, tmp: Path, topic_config: BridgeConfig | None, n: int,
                      changelog: bool = True) -> FailureRun:
    """One bridge run where every first attempt fails. Steady state: from the first PENDING task counted to the
    n-th stored, and to the n-th in the changelog (a backlog the writer has not logged is not done: its source
    offsets are not committed). Measured while running, not after the bridge stopped."""
    registry = Registry()

    def always_fails(ctx: HandlerContext) -> None:
        raise ConnectionError("downstream is down")

    registry.register("fails", always_fails)
    config = topic_config or bench_config(bootstrap, tmp, {"handler": "fails", "max_attempts": 5,
                                                           "backoff": {"kind": "fixed", "base": "1h"},
                                                           **NO_BREAKER})
    if topic_config is None:
        ensure_topics(config)
        produce(bootstrap, config.queues["q"].sources[0], n)
    run = regrouped(config, f"{uuid.uuid4().hex[:6]}-{'on' if changelog else 'off'}")
    run = run.model_copy(update={"store": run.store.model_copy(update={"changelog": changelog})})
    marks: dict[str, float] = {}
    writer: dict[str, dict[str, float]] = {}

    async def all_stored_and_logged(bridge: Bridge) -> bool:
        created = bridge.telemetry.metrics.tasks_created.labels("q", "PENDING")._value.get()
        now = time.perf_counter()
        if created and "first" not in marks:
            marks["first"], marks["first_n"] = now, created
            writer["first"] = dict(bridge.changelog.writer.seconds) if bridge.changelog else {}
        if created >= n and "stored" not in marks:
            marks["stored"] = now
        logged = bridge.changelog is None or bridge.changelog.writer.stats["records"] >= n
        if "stored" in marks and logged:
            marks["logged"] = now
            writer["last"] = dict(bridge.changelog.writer.seconds) if bridge.changelog else {}
            helper = bridge.changelog.writer.local.outbox_reader.process.pid() if bridge.changelog else None
            marks["helper_rss"] = rss_mib(helper) if helper else 0.0
        return "logged" in marks

    _, bridge = await run_bridge_until(run, all_stored_and_logged, registry)
    steady = n - marks["first_n"]  # 0 when the first commit held them all (a tiny run): every rate 0, not 0/0
    seconds = max(marks["logged"] - marks["first"], 1e-9)
    shares = {k: (writer["last"][k] - writer["first"][k]) / seconds for k in writer.get("last", {})}
    return FailureRun(steady / max(marks["stored"] - marks["first"], 1e-9), steady / seconds, config, bridge, shares,
                      marks["helper_rss"])


async def bench_failure(bootstrap: str, n: int, runs: int) -> None:
    stored: list[float] = []
    on: list[float] = []
    off: list[float] = []
    baselines: list[float] = []
    ratios: list[float] = []
    batches: list[str] = []
    writer: list[str] = []
    rss: list[float] = []
    helpers: list[float] = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config: BridgeConfig | None = None
        for _ in range(runs):
            run = await failure_run(bootstrap, Path(tmp), config, n)
            config, stats, shares = run.config, run.bridge.store.stats, run.shares
            batches.append(f"{stats.batches} (largest {stats.largest_batch})")
            writer.append(f"{sum(shares.values()):.0%} (" + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
                          + ")")
            off_run = await failure_run(bootstrap, Path(tmp), config, n, changelog=False)
            baseline_path = Path(tmp) / f"plain-{uuid.uuid4().hex[:6]}.db"
            schema = await Store.open(baseline_path)
            await schema.close()
            baseline = plain_inserts(baseline_path, new_failures(n, 0), 500)
            stored.append(run.stored)
            on.append(run.logged)
            off.append(off_run.logged)
            baselines.append(baseline)
            ratios.append(run.logged / baseline)
            rss.append(rss_mib())
            helpers.append(run.helper_rss)
    record("failure path: every first attempt fails and is stored durably (synchronous=FULL)", [
        f"records: {n} x 1 KB through Kafka; each becomes a PENDING task with its first attempt; {runs} runs",
        "rate: steady state, from the first task stored to the n-th stored and in the changelog (measured while "
        "running); production defaults (changelog on) but the " + NO_BREAKER_NOTE,
        f"baseline: plain executemany of the same rows, 500 per transaction: {_spread(baselines)} rows/s",
        f"bridge, changelog on (the default): {_spread(on)} records/s; ratio min/median/max {_spread(ratios, '.2f')}"
        "  (goal >= 0.5 and >= 5000/s)",
        f"  of which stored in SQLite (the n-th stored, not yet all in the changelog): {_spread(stored)} records/s",
        f"bridge, changelog off (SQLite only): {_spread(off)} records/s",
        f"store transactions per run (changelog on): {', '.join(batches)}",
        "the changelog writer's share of the steady phase, by step (its rounds run one at a time: read the "
        f"outbox, produce + commit the transaction, mark logged, release offsets): {'; '.join(writer)}",
        f"RSS of the bench process after each run: {', '.join(f'{r:.0f}' for r in rss)} MiB; of the changelog's "
        "outbox process (outbox_read.py) at the end of each run's steady phase: "
        f"{', '.join(f'{r:.0f}' for r in helpers)} MiB (0: none ran)",
    ])


# ---- 5. DLQ publish -----------------------------------------------------------------------------------------


async def dead_tasks(store: Store, n: int) -> None:
    error = ErrorInfo("ConnectionError", "connect timed out after 500ms", "Traceback …\n" * 20)
    now = int(time.time() * 1000)
    tasks = [NewTask("q", "ok", PAYLOAD, {"rdq.source": f"kafka://in/0/{i}", "traceparent": "00-" + "a" * 32
                                           + "-" + "b" * 16 + "-01", "rdq.kafka.key": "a2V5"},
                     Status.DEAD, now, Attempt(1, 0, now, now, Outcome.RETRYABLE_FAILURE, error, "w"),
                     dead_reason=error) for i in range(n)]
    for start in range(0, n, 1000):
        await asyncio.gather(*(store.submit(t) for t in tasks[start : start + 1000]))

    def more_attempts(conn: Any) -> None:
        rows = [Attempt(k, 0, now, now, Outcome.RETRYABLE_FAILURE, error, "w").params(t.id)
                for t in tasks for k in range(2, 6)]
        conn.executemany(q("insert_attempt"), rows)

    await store.db.write(more_attempts)


def timed(spent: dict[str, float], name: str, fn: Any) -> Any:
    """`fn` (a coroutine function) adding its time to spent[name]: where a serial loop's time goes."""

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - began

    return wrapper


async def dlq_run(bootstrap: str, tmp: Path, n: int) -> tuple[float, float, float, dict[str, float]]:
    """(bare producer records/s, DLQ publisher records/s, envelope bytes, share of the publisher's time by step)
    for n DEAD tasks."""
    config = bench_config(bootstrap, tmp, {"handler": "ok"})
    ensure_topics(config)
    store = await Store.open(config.store.path)
    await dead_tasks(store, n)
    tasks = await store.dlq_outbox(limit=n)
    assert len(tasks) == n and len(tasks[0].attempts) == 5
    records = [build_record(t, 8_000_000) for t in tasks]
    topic = config.dlq_topic("q")
    producer = make_dlq_producer(config, 1_000_000)
    began = time.perf_counter()
    for r in records:
        while True:
            try:
                producer.produce(topic, value=r.value, key=r.key, headers=r.headers)  # type: ignore[arg-type]
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(120) == 0
    bare = n / (time.perf_counter() - began)
    publisher = DlqPublisher(store, config, lambda batch: make_dlq_producer(config, batch),
                             lambda: make_admin(config), _Clock(), asyncio.Event())  # production batch
    # Its loop: wait for the batch read ahead (the next one is read while this one is built), build and produce
    # each, look for stuck entries (once a second); the acknowledgements and the "published" marks run beside it.
    spent: dict[str, float] = {}
    publisher.publish_due = timed(spent, "round", publisher.publish_due)  # type: ignore[method-assign]
    publisher._produce = timed(spent, "build + produce", publisher._produce)  # type: ignore[method-assign]
    publisher._report_stuck = timed(spent, "stuck check", publisher._report_stuck)  # type: ignore[method-assign]
    stop = asyncio.Event()
    began = time.perf_counter()
    runner = asyncio.create_task(publisher.run(stop))
    while publisher.published < n:  # noqa: ASYNC110 - polling is the measure
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - began
    stop.set()
    await runner
    await store.close()
    steps = {"waiting for the outbox read": spent.pop("round") - sum(spent.values()), **spent}
    return bare, n / elapsed, sum(len(r.value) for r in records) / n, {k: v / elapsed for k, v in steps.items()}


async def bench_dlq(bootstrap: str, n: int, runs: int) -> None:
    bares, rates, ratios, rss = [], [], [], []
    shares: list[str] = []
    size = 0.0
    for _ in range(runs):
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            bare, rate, size, spent = await dlq_run(bootstrap, Path(tmp), n)
        shares.append(", ".join(f"{k} {v:.0%}" for k, v in spent.items()))
        bares.append(bare)
        rates.append(rate)
        ratios.append(rate / bare)
        rss.append(rss_mib())
    record("DLQ: DEAD tasks with 5-attempt histories published (idempotent, acks=all)", [
        f"tasks: {n}, envelope ~{size / 1024:.1f} KB each; {runs} runs",
        f"baseline: bare idempotent producer, the same records pre-built: {_spread(bares)} records/s",
        f"bridge DLQ outbox, production batch 500 (read, build, produce, ack, mark published): {_spread(rates)} "
        f"records/s; ratio min/median/max {_spread(ratios, '.2f')}  (goal >= 0.8)",
        f"the publisher's time by step, share of the run: {'; '.join(shares)}",
        f"RSS of the bench process after each run: {', '.join(f'{r:.0f}' for r in rss)} MiB",
    ])


class _Clock:
    def now_ms(self) -> int:
        return int(time.time() * 1000)


# ---- 6. end to end ------------------------------------------------------------------------------------------


async def e2e_run(bootstrap: str, tmp: Path, n: int, changelog: bool = True,
                  synchronous: str = "FULL") -> tuple[list[float], float, tuple[float, float]]:
    """One run: (task created → succeeded latencies in ms, one durable store write's p50 in ms, (store commits,
    fsync'd store commits) per record)."""
    config = bench_config(bootstrap, tmp, {"handler": "flaky", "max_attempts": 3,
                                           "backoff": {"kind": "fixed", "base": 0, "jitter": "none"}, **NO_BREAKER})
    config = config.model_copy(update={"store": config.store.model_copy(update={"changelog": changelog,
                                                                                  "synchronous": synchronous})})
    topic = config.queues["q"].sources[0]
    ensure_topics(config)
    feeder: list[asyncio.Task[None]] = []
    latencies: list[float] = []

    ready: list[float] = []

    async def all_succeeded(bridge: Bridge) -> bool:
        if not feeder:
            # Steady state: records flow once the bridge owns every partition (restored) and a second more:
            # a partition resumed after its restore joins librdkafka's next fetch request, up to
            # fetch.wait.max.ms (500 ms) later. Sent earlier, the records arrive as one burst and the figure is
            # that burst's drain time (the startup figure, reported by the restore benchmark), not a retry's.
            if not ready and all(bridge.consumer.owns(topic, p) for p in range(PARTITIONS)):
                ready.append(time.monotonic())
            if ready and time.monotonic() - ready[0] >= 1.0:
                feeder.append(asyncio.create_task(asyncio.to_thread(produce_paced, bootstrap, topic, n, 400)))
            return False
        # A cheap poll (a counter), then one read while running: with the changelog, a stopping bridge hands
        # its tasks over and drops them from its file. (Scanning the table every poll loaded the bridge.)
        if bridge.telemetry.metrics.attempts.total("q", Outcome.SUCCESS) < n:
            return False
        latencies[:] = await bridge.store.db.scan(lambda c: [r[0] for r in c.execute(
            "SELECT finished_at - created_at FROM tasks WHERE status = 'SUCCEEDED'")])
        return len(latencies) >= n

    _, bridge = await run_bridge_until(config, all_succeeded)
    await feeder[0]
    store = await Store.open(tmp / "writes.db")
    writes = []  # baseline: what one durable write costs here (a group-committed fsync'd insert), same run
    for t in new_failures(200, 0):
        began = time.perf_counter()
        await store.submit(t)
        writes.append((time.perf_counter() - began) * 1000)
    await store.close()
    stats = bridge.store.stats
    return latencies, percentile(writes, 50), (stats.batches / n, stats.synced / n)


async def bench_e2e(bootstrap: str, n: int, runs: int) -> None:
    p50s, p99s, maxes, writes, rss = [], [], [], [], []
    off_p50s, off_p99s, normal_p50s, normal_p99s, per_record, synced = [], [], [], [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            latencies, write, commits = await e2e_run(bootstrap, Path(tmp), n)
        per_record.append(commits[0])
        synced.append(commits[1])
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            off, _, _ = await e2e_run(bootstrap, Path(tmp), n, changelog=False)
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            normal, _, _ = await e2e_run(bootstrap, Path(tmp), n, changelog=False, synchronous="NORMAL")
        off_p50s.append(percentile(off, 50))
        off_p99s.append(percentile(off, 99))
        normal_p50s.append(percentile(normal, 50))
        normal_p99s.append(percentile(normal, 99))
        p50s.append(percentile(latencies, 50))
        p99s.append(percentile(latencies, 99))
        maxes.append(max(latencies))
        writes.append(write)
        rss.append(rss_mib())
    record("end to end: first failure stored → successful retry, zero backoff", [
        f"records: {n} at ~400/s, each failing once (flaky) then succeeding on its first retry; {runs} runs; "
        "production defaults (changelog on) but the " + NO_BREAKER_NOTE,
        f"latency the scheduler adds (task created → succeeded), min/median/max over the runs: "
        f"p50 {_spread(p50s, '.1f')} ms, p99 {_spread(p99s, '.1f')} ms, max {_spread(maxes)} ms  "
        "(goal p99 < 20 ms, issue 25)",
        f"the same with the changelog off (SQLite only; the next step's measure): p50 {_spread(off_p50s, '.1f')} ms, "
        f"p99 {_spread(off_p99s, '.1f')} ms",
        "the same, changelog off and synchronous=NORMAL (no fsync per commit: not a production setting, the "
        f"measure of what the commits' fsyncs cost): p50 {_spread(normal_p50s, '.1f')} ms, "
        f"p99 {_spread(normal_p99s, '.1f')} ms",
        f"store commits per record, changelog on, the whole run: {_spread(per_record, '.2f')}; of them fsync'd "
        f"(not the in-flight journal's alone): {_spread(synced, '.2f')}",
        f"baseline: one durable store write, p50 {_spread(writes, '.2f')} ms",
        f"RSS of the bench process after each run: {', '.join(f'{r:.0f}' for r in rss)} MiB",
    ])


def produce_paced(bootstrap: str, topic: str, n: int, per_second: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1})
    began = time.monotonic()
    for i in range(n):
        producer.produce(topic, value=b'{"fail": 1}', key=str(i).encode())
        producer.poll(0)
        delay = began + (i + 1) / per_second - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    producer.flush(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["happy", "bookkeeping", "failure", "dlq", "e2e", "ordering", "all"])
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (min/median/max reported)")
    args = parser.parse_args()
    tune_gc()  # the bridges run in this process: set up as `rdq run` sets up its own (production defaults)
    with broker() as bootstrap:
        if args.which in ("happy", "all"):
            asyncio.run(bench_happy(bootstrap, args.n or 100_000, args.runs))
        if args.which in ("bookkeeping", "all"):
            asyncio.run(bench_bookkeeping(bootstrap, args.n or 100_000, args.runs))
        if args.which in ("failure", "all"):
            asyncio.run(bench_failure(bootstrap, args.n or 20_000, args.runs))
        if args.which in ("dlq", "all"):
            asyncio.run(bench_dlq(bootstrap, args.n or 5_000, args.runs))
        if args.which in ("e2e", "all"):
            asyncio.run(bench_e2e(bootstrap, args.n or 2_000, args.runs))
        if args.which in ("ordering", "all"):
            asyncio.run(bench_ordering(bootstrap, args.n or 100_000, args.runs))


if __name__ == "__main__":
    main()
