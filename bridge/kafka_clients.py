"""Kafka clients built from the config: every client gets `kafka.client` passed through to librdkafka."""

from __future__ import annotations

from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bridge.config import BridgeConfig


def _base(config: BridgeConfig) -> dict[str, Any]:
    return {"bootstrap.servers": config.kafka.bootstrap_servers, **config.kafka.client}


def producer_config(config: BridgeConfig, **overrides: Any) -> dict[str, Any]:
    # Idempotence implies acks=all and ordered, de-duplicated retries: what the DLQ outbox relies on.
    return {**_base(config), "enable.idempotence": True, "acks": "all", "linger.ms": 5, **config.kafka.producer,
            **overrides}


def consumer_config(config: BridgeConfig, **overrides: Any) -> dict[str, Any]:
    # Offsets are stored by the bridge only once a record is done or durably stored (SPEC §4.10).
    return {
        **_base(config),
        "group.id": config.kafka.group_id,
        "enable.auto.commit": True,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "partition.assignment.strategy": "cooperative-sticky",
        "auto.commit.interval.ms": 1000,
        **config.kafka.consumer,
        **overrides,
    }


def make_producer(config: BridgeConfig, **overrides: Any) -> Producer:
    return Producer(producer_config(config, **overrides))


def make_dlq_producer(config: BridgeConfig, batch_bytes: int) -> Producer:
    return make_producer(config, **{"message.max.bytes": config.kafka.dlq_max_message_bytes,
                                    "batch.size": batch_bytes})


def make_consumer(config: BridgeConfig, **overrides: Any) -> Consumer:
    return Consumer(consumer_config(config, **overrides))


def make_admin(config: BridgeConfig) -> AdminClient:
    return AdminClient(_base(config))


def ensure_topics(config: BridgeConfig, timeout: float = 30.0) -> list[str]:
    """Create the config's topics that are missing. Returns the names created."""
    admin = make_admin(config)
    existing = set(admin.list_topics(timeout=timeout).topics)
    wanted = [t for t in config.topics() if t not in existing]
    if not wanted:
        return []
    dlq_topics = {config.dlq_topic(q) for q in config.queues}
    dlq_settings = {"max.message.bytes": str(config.kafka.dlq_max_message_bytes)}
    new = [
        NewTopic(t, num_partitions=config.kafka.topic_partitions,
                 replication_factor=config.kafka.topic_replication_factor,
                 config=dlq_settings if t in dlq_topics else {})
        for t in wanted
    ]  # fmt: skip
    created = []
    for topic, future in admin.create_topics(new, operation_timeout=timeout).items():
        try:
            future.result(timeout)
            created.append(topic)
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    return created


def broker_reachable(config: BridgeConfig, timeout: float = 5.0) -> bool:
    try:
        make_admin(config).list_topics(timeout=timeout)
    except KafkaException:
        return False
    return True
