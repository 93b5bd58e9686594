"""One trace per record across attempts, DLQ and redrive; metrics; /metrics, /healthz, /readyz (SPEC §9)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from bridge.records import trace_id
from bridge.source.ownership import Ownership
from bridge.telemetry.core import Telemetry
from localkafka import LocalBroker
from tests.conftest import KafkaEnv
from tests.kafka_helpers import aread_dlq, example_log, kafka_config, produce, running_bridge, wait_until

pytestmark = pytest.mark.kafka
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"


def traced() -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Telemetry(provider=provider, group_id="g"), exporter


async def test_a_record_that_fails_twice_then_succeeds_is_one_trace(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                                                   example_log_path: Path) -> None:
    telemetry, exporter = traced()
    topic = f"in-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "flaky", "sources": [topic], "dlq_topic": f"dlq-{unique}", "max_attempts": 4,
              "backoff": {"kind": "fixed", "base": "20ms"}}})
    async with running_bridge(config, telemetry=telemetry):
        produce(config, topic, [(b"order-1", b'{"fail": 2}', [("traceparent", TRACEPARENT.encode())])])
        await wait_until(lambda: example_log(example_log_path), what="the success")
        await asyncio.sleep(0.2)
    spans = exporter.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in spans} == {TRACE}  # one trace
    [consume] = [s for s in spans if s.name == f"process {topic}"]
    attempts = sorted((s for s in spans if s.name == "attempt q"), key=lambda s: s.attributes["rdq.attempt"])
    assert format(consume.parent.span_id, "016x") == PARENT and consume.kind.name == "CONSUMER"
    assert consume.attributes["messaging.system"] == "kafka"
    assert consume.attributes["messaging.destination.name"] == topic
    assert consume.attributes["messaging.destination.partition.id"] is not None
    assert consume.attributes["messaging.kafka.offset"] == 0
    assert consume.attributes["messaging.consumer.group.name"] == "g"
    assert [a.attributes["rdq.attempt"] for a in attempts] == [1, 2, 3]
    assert [a.attributes["rdq.outcome"] for a in attempts] == ["RETRYABLE_FAILURE", "RETRYABLE_FAILURE", "SUCCESS"]
    assert len({a.attributes["rdq.task.id"] for a in attempts}) == 1
    assert all(a.attributes["rdq.queue"] == "q" for a in attempts)
    assert attempts[0].parent.span_id == consume.context.span_id  # inline, under the consume span
    assert all(format(a.parent.span_id, "016x") == PARENT for a in attempts[1:])  # retries: under the source


async def test_a_dead_record_adds_the_dlq_publish_to_the_trace(kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    telemetry, exporter = traced()
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "permanent", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}"}})
    async with running_bridge(config, telemetry=telemetry) as bridge:
        produce(config, f"in-{unique}", [(None, b"{}", [("traceparent", TRACEPARENT.encode())])])
        [record] = await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", expect=1)
        [task] = await bridge.store.list_tasks()
        await bridge.engine.redrive(task.id, by="sre")
        await asyncio.sleep(0.5)
    spans = exporter.get_finished_spans()
    dlq_traceparent = record.headers["traceparent"].decode()
    assert trace_id(dlq_traceparent) == TRACE  # the DLQ record belongs to the record's trace
    # The redriven task died again and was published again: the first publish is this record's.
    [publish] = [s for s in spans if s.name == f"publish dlq-{unique}"
                 and format(s.context.span_id, "016x") == dlq_traceparent.split("-")[2]]
    assert publish.kind.name == "PRODUCER" and format(publish.context.trace_id, "032x") == TRACE
    assert publish.attributes["rdq.task.id"] == task.id
    [redrive] = [s for s in spans if s.name == "redrive"]
    assert format(redrive.links[0].context.trace_id, "032x") == TRACE  # a redrive links back


async def test_tracing_off_records_no_spans(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                            example_log_path: Path) -> None:
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "ok", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}"}})
    async with running_bridge(config) as bridge:
        assert not bridge.telemetry.tracing and bridge.telemetry.provider is None
        produce(config, f"in-{unique}", [(None, b"{}", [])])
        await wait_until(lambda: example_log(example_log_path), what="the success")
        assert bridge.telemetry.metrics.records.labels("q")._value.get() == 1


async def test_the_parent_based_sampler_builds_spans_only_for_sampled_records(
        kafka: KafkaEnv, tmp_path: Path, unique: str, example_log_path: Path) -> None:
    """sample_ratio 0: a record whose producer sampled it (flag 01) is traced through its retry; one marked
    unsampled (00) and one without a traceparent are not — and the latter's task carries the decision (00), so
    its retry and anything downstream of it are not traced either."""
    from bridge.config import TelemetryConfig
    from bridge.telemetry.core import sampler

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler(0.0))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(TelemetryConfig(sample_ratio=0.0), provider=provider, group_id="g")
    unsampled = "00-" + "c" * 32 + "-" + "d" * 16 + "-00"
    topic = f"in-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "flaky", "sources": [topic], "dlq_topic": f"dlq-{unique}", "max_attempts": 3,
              "backoff": {"kind": "fixed", "base": "20ms"}}})
    async with running_bridge(config, telemetry=telemetry) as bridge:
        produce(config, topic, [(b"sampled", b'{"fail": 1}', [("traceparent", TRACEPARENT.encode())]),
                                (b"unsampled", b'{"fail": 1}', [("traceparent", unsampled.encode())]),
                                (b"root", b'{"fail": 1}', [])])
        await wait_until(lambda: len(example_log(example_log_path)) == 3, what="three successes on retry")
        await asyncio.sleep(0.2)
        tasks = await bridge.store.list_tasks()
    spans = exporter.get_finished_spans()
    assert spans and {format(s.context.trace_id, "032x") for s in spans} == {TRACE}
    assert sorted(s.attributes["rdq.attempt"] for s in spans if s.name == "attempt q") == [1, 2]
    [root] = [t for t in tasks if "rdq.kafka.headers" not in t.headers]
    assert root.headers["traceparent"].endswith("-00")  # the sampler's decision travels with the task


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def status(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def test_metrics_after_a_scripted_scenario(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                                 example_log_path: Path) -> None:
    topic = f"in-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "flaky", "sources": [topic], "dlq_topic": f"dlq-{unique}", "max_attempts": 2,
              "backoff": {"kind": "fixed", "base": "20ms"}, "errors": {"permanent": ["Permanent"]}}},
        telemetry={"port": 0})
    payloads = [b'{"fail": 0}'] * 5 + [b'{"fail": 1}'] * 2 + [b'{"fail": 99}'] + [b"not json"]
    async with running_bridge(config) as bridge:
        produce(config, topic, [(None, p, []) for p in payloads])
        await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", expect=2)
        await wait_until(lambda: bridge.dlq.published == 2 and len(example_log(example_log_path)) == 7,
                         what="the scenario to finish")
        assert bridge.health is not None and bridge.health.bound_port
        await asyncio.sleep(2.5)  # one health probe round for the open-tasks gauge
        m = await asyncio.to_thread(scrape, bridge.health.bound_port)
        code, _ = await asyncio.to_thread(status, bridge.health.bound_port, "/healthz")
    q = (("queue", "q"),)
    assert m[("rdq_records_consumed_total", q)] == 9
    assert m[("rdq_attempts_total", (("outcome", "SUCCESS"), ("queue", "q")))] == 7
    assert m[("rdq_attempts_total", (("outcome", "RETRYABLE_FAILURE"), ("queue", "q")))] == 4
    assert m[("rdq_attempts_total", (("outcome", "PERMANENT_FAILURE"), ("queue", "q")))] == 1
    assert m[("rdq_tasks_created_total", (("queue", "q"), ("status", "PENDING")))] == 3
    assert m[("rdq_tasks_created_total", (("queue", "q"), ("status", "DEAD")))] == 1
    assert m[("rdq_dead_total", (("error_type", "bridge.handler_api.Permanent"), ("queue", "q")))] == 1
    assert m[("rdq_dead_total", (("error_type", "handlers.examples.TransientError"), ("queue", "q")))] == 1
    assert m[("rdq_dlq_published_total", q)] == 2
    assert m[("rdq_time_to_success_seconds_count", q)] == 2
    assert m[("rdq_handler_duration_seconds_count", q)] == 12
    assert m[("rdq_open_tasks", (("queue", "q"), ("status", "PENDING")))] == 0
    assert m[("rdq_ready", ())] == 1 and code == 200
    assert m[("rdq_breaker_state", q)] == 0  # closed: 1 of 12 attempts failed retryably
    assert not [name for name, _ in m if name.endswith("_created")]  # no `_created` series beside the counters


async def test_readyz_follows_the_broker(tmp_path: Path, unique: str, stoppable_broker: LocalBroker) -> None:
    broker = stoppable_broker
    try:
        config = kafka_config(broker.bootstrap_servers, tmp_path, unique, {
            "q": {"handler": "ok", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}"}},
            telemetry={"port": 0})
        async with running_bridge(config) as bridge:
            assert bridge.health is not None

            async def ready_is(expected: bool) -> bool:
                if not bridge.health or not bridge.health.bound_port:
                    return False
                code, body = await asyncio.to_thread(status, bridge.health.bound_port, "/readyz")
                return (code == 200) == expected and body["ready"] == expected

            # Ready, and the group's assignment restored (a restore waits for the broker: stopped as the
            # assignment arrives, the partitions would be restoring until it came back).
            await wait_until(lambda: bridge.health is not None and bridge.health.ready and all(
                bridge.consumer.owns(f"in-{unique}", p) for p in range(3)), within=30, what="ready, restored")
            await wait_until(lambda: ready_is(True), within=30, what="ready")
            await asyncio.to_thread(broker.stop)
            await wait_until(lambda: ready_is(False), within=30, what="not ready without a broker")
            _, body = await asyncio.to_thread(status, bridge.health.bound_port, "/readyz")
            # The breakers are shown, not part of readiness (an open one is the downstream's outage).
            assert body == {"ready": False, "broker": False, "store": True, "joined": True, "restoring": [],
                            "breakers": {"q": "closed"}}
            await asyncio.to_thread(broker.start)
            await wait_until(lambda: ready_is(True), within=60, what="ready again")
    finally:
        await asyncio.to_thread(broker.start)  # running again for the tests after this one (a no-op if it runs)


async def test_readyz_waits_for_the_groups_first_assignment(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A new instance is not ready until the consumer group gave it its share: a rolling deploy moves on at a
    pod's first 200, and ready before its member joined, the next old pod would go while this one holds nothing
    yet. The assignment is held back on the consumer thread here; broker and store are fine all along."""
    arrived, released = threading.Event(), threading.Event()
    assign = Ownership.on_assign

    def held_assign(self: Ownership, consumer: Any, partitions: list[Any]) -> None:
        arrived.set()
        released.wait(60)
        assign(self, consumer, partitions)

    monkeypatch.setattr(Ownership, "on_assign", held_assign)
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "ok", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}"}},
        telemetry={"port": 0})
    async with running_bridge(config) as bridge:
        health = bridge.health
        assert health is not None
        try:
            await wait_until(lambda: arrived.is_set() and health.broker_ok and health.bound_port, within=30,
                             what="the assignment arriving, the broker answering")
            code, body = await asyncio.to_thread(status, health.bound_port, "/readyz")  # type: ignore[arg-type]
            assert (code, body["ready"], body["joined"]) == (503, False, False), body
            assert body["broker"] and body["store"] and body["restoring"] == [], body
        finally:
            released.set()
        await wait_until(lambda: health.ready, within=30, what="ready once assigned and restored")
        assert all(bridge.consumer.owns(f"in-{unique}", p) for p in range(3))
        code, body = await asyncio.to_thread(status, health.bound_port, "/readyz")  # type: ignore[arg-type]
        assert (code, body["joined"]) == (200, True), body


async def test_readyz_turns_false_when_the_store_cannot_be_written(kafka: KafkaEnv, tmp_path: Path,
                                                                   unique: str) -> None:
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "permanent", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}"}},
        telemetry={"port": 0})
    async with running_bridge(config) as bridge:
        assert bridge.health is not None
        await wait_until(lambda: bridge.health is not None and bridge.health.ready and all(
            bridge.consumer.owns(f"in-{unique}", p) for p in range(3)), within=30, what="ready, partitions restored")
        await bridge.store.limit_size(await bridge.store.size_bytes())
        produce(config, f"in-{unique}", [(None, b"x" * 50_000, [])])
        await wait_until(lambda: bridge.health is not None and not bridge.health.ready, within=30, what="unready")
        code, body = await asyncio.to_thread(status, bridge.health.bound_port, "/readyz")  # type: ignore[arg-type]
        assert code == 503 and body["store"] is False, body
        await bridge.store.limit_size(None)
        await wait_until(lambda: bridge.health is not None and bridge.health.ready, within=30, what="ready again")
