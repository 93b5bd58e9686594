"""The foundation on a real broker: topics from the config, produce and consume through the project's clients."""

from __future__ import annotations

import time

import pytest

from bridge.config import BridgeConfig
from bridge.kafka_clients import broker_reachable, ensure_topics, make_admin, make_consumer, make_producer
from tests.conftest import KafkaEnv

pytestmark = pytest.mark.kafka


def test_ensure_topics_creates_every_configured_topic_once(bridge_config: BridgeConfig) -> None:
    created = ensure_topics(bridge_config)
    changelogs = [bridge_config.changelog_topic(t) for t in bridge_config.source_topics()]
    assert sorted(created) == sorted(bridge_config.topics() + changelogs)
    assert ensure_topics(bridge_config) == []
    topics = make_admin(bridge_config).list_topics(timeout=10).topics
    for name in bridge_config.topics() + changelogs:
        assert len(topics[name].partitions) == bridge_config.kafka.topic_partitions


def test_produce_and_consume_through_project_clients(bridge_config: BridgeConfig) -> None:
    ensure_topics(bridge_config)
    topic = bridge_config.queues["orders.process"].sources[0]
    producer = make_producer(bridge_config)
    sent = {f"k{i}".encode(): f'{{"fail": {i % 3}}}'.encode() for i in range(20)}
    headers = [("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), ("bin", b"\xff\x00")]
    for key, value in sent.items():
        producer.produce(topic, value=value, key=key, headers=headers)
    assert producer.flush(30) == 0

    consumer = make_consumer(bridge_config)
    consumer.subscribe([topic])
    got: dict[bytes, bytes] = {}
    deadline = time.monotonic() + 60
    try:
        while len(got) < len(sent) and time.monotonic() < deadline:
            for msg in consumer.consume(100, 1.0):
                assert msg.error() is None, msg.error()
                got[msg.key()] = msg.value()
                assert dict(msg.headers())["bin"] == b"\xff\x00"
                consumer.store_offsets(msg)
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    assert got == sent


def test_broker_reachable(bridge_config: BridgeConfig, kafka: KafkaEnv) -> None:
    assert broker_reachable(bridge_config)
    dead = bridge_config.model_copy(update={"kafka": bridge_config.kafka.model_copy(
        update={"bootstrap_servers": "127.0.0.1:1"})})
    assert not broker_reachable(dead, timeout=1.0)


def test_librdkafka_logs_go_through_python_logging_not_raw_stderr(capfd: pytest.CaptureFixture[str],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A broker that refuses connections: librdkafka's complaints arrive as `rdq.kafka` log records (the bridge's
    JSON lines), not as raw `%3|…|FAIL|…` text between them."""
    import logging

    from bridge.config import parse_config

    config = parse_config({"kafka": {"bootstrap_servers": "127.0.0.1:1"},
                           "queues": {"q": {"handler": "ok", "sources": ["t"]}}, "engine": {"handler_modules": []}})
    caplog.set_level(logging.INFO, logger="rdq.kafka")
    producer = make_producer(config)
    producer.produce("t", b"x")
    consumer = make_consumer(config)
    consumer.subscribe(["t"])
    for _ in range(10):
        producer.poll(0.1)
        consumer.poll(0.1)
    consumer.close()
    producer.purge()
    raw = capfd.readouterr().err
    assert "|FAIL|" not in raw and "%3|" not in raw, raw[:500]
    assert any(r.name == "rdq.kafka" and "Connection refused" in r.getMessage() for r in caplog.records)


def test_the_test_reader_reads_every_record_however_short_its_settle(bridge_config: BridgeConfig) -> None:
    """tests' `read_topic` (and `read_dlq`, the fault suite's DLQ check) stops once nothing new came for `settle`
    seconds. Counted from its start, a settle shorter than its group's join and first fetch read nothing (the
    nemesis waited 4 minutes for 7 poison pills that were in their DLQ; here: 48 partitions, 0 of 7 read);
    counted once every partition's first fetch answered, it reads them all. A topic that is not there reads as
    empty, without waiting."""
    import uuid

    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    from tests.kafka_helpers import read_topic

    topic = f"reader-{uuid.uuid4().hex[:10]}"
    admin = make_admin(bridge_config)
    for future in admin.create_topics([NewTopic(topic, 48, 1)]).values():
        future.result(30)
    producer = make_producer(bridge_config)
    for i in range(7):
        producer.produce(topic, value=b"{}", key=f"k{i}".encode())
    assert producer.flush(30) == 0
    bootstrap = bridge_config.kafka.bootstrap_servers
    assert len(read_topic(bootstrap, topic, settle=0.1, timeout=30)) == 7
    began = time.monotonic()
    assert read_topic(bootstrap, f"{topic}-not-there", settle=0.1, timeout=30) == []
    assert time.monotonic() - began < 10
