"""The local broker tooling: cache reuse, restart keeping data and ports."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from localkafka import LocalBroker, cache_root, resolve_jars

pytestmark = pytest.mark.kafka


def test_resolve_reuses_the_cache() -> None:
    libs = resolve_jars()
    assert (libs / ".complete").exists() and libs.parent == cache_root()
    began = time.monotonic()
    assert resolve_jars() == libs
    assert time.monotonic() - began < 1.0  # no Maven run the second time
    assert any(libs.glob("kafka_2.13-*.jar")) and any(libs.glob("log4j-slf4j-impl-*.jar"))


def test_restart_keeps_ports_and_data(tmp_path: Path) -> None:
    broker = LocalBroker(tmp_path / "k").start()
    try:
        conf = {"bootstrap.servers": broker.bootstrap_servers}
        admin = AdminClient(conf)  # kept referenced: a collected client cancels its futures
        admin.create_topics([NewTopic("keep", 1, 1)])["keep"].result(30)
        producer = Producer(conf)
        producer.produce("keep", b"before-restart")
        assert producer.flush(30) == 0
        port = broker.port
        broker.stop()
        broker.start()
        assert broker.port == port
        consumer = Consumer({**conf, "group.id": "g", "auto.offset.reset": "earliest"})
        consumer.subscribe(["keep"])
        values = []
        deadline = time.monotonic() + 60
        while not values and time.monotonic() < deadline:
            values = [m.value() for m in consumer.consume(10, 1.0) if m.error() is None]
        consumer.close()
        assert values == [b"before-restart"]
        assert broker.rss_bytes() > 0
    finally:
        broker.stop()
