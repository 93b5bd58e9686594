"""The source consumer's poll (bridge/source/consumer.py) on a real broker: while records flow, one `consume` call
a poll (each call gives the GIL up and waits to take it back); with nothing fetched, a wait for the first record."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from bridge.source.consumer import _POLL_TIMEOUT, SourceConsumer
from tests.conftest import KafkaEnv

pytestmark = pytest.mark.kafka


class CountingConsumer:
    """A real consumer whose `consume` calls are recorded (how many, with what)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.calls: list[tuple[int, float]] = []

    def consume(self, n: int, timeout: float) -> list[Any]:
        self.calls.append((n, timeout))
        return self.consumer.consume(n, timeout)


def test_a_poll_takes_what_is_fetched_in_one_call_and_waits_only_when_nothing_is(kafka: KafkaEnv,
                                                                                   unique: str) -> None:
    topic = f"poll-{unique}"
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for i in range(50):
        producer.produce(topic, b"%d" % i)
    assert producer.flush(30) == 0
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"g-{unique}",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, 0)])
    counting = CountingConsumer(consumer)
    poller = SimpleNamespace(kafka=counting, _poll_size=10)  # what `_poll` reads of its consumer
    try:
        offsets: list[int] = []
        deadline = time.monotonic() + 30
        while not offsets and time.monotonic() < deadline:  # the first fetch: maybe waited for
            offsets = [m.offset() for m in SourceConsumer._poll(poller)]  # type: ignore[arg-type]
        assert offsets, "nothing fetched within 30 s"
        time.sleep(0.5)  # the rest of the 50 fetched meanwhile (one fetch brings them all)
        while len(offsets) < 50:
            counting.calls.clear()
            batch = SourceConsumer._poll(poller)  # type: ignore[arg-type]
            assert counting.calls == [(10, 0)], "records were waiting: one call, taking up to the poll's size"
            offsets += [m.offset() for m in batch]
        assert offsets == list(range(50))
        counting.calls.clear()
        assert SourceConsumer._poll(poller) == []  # type: ignore[arg-type]
        assert counting.calls == [(10, 0), (1, _POLL_TIMEOUT)]  # nothing fetched: then a wait for the first
    finally:
        consumer.close()
