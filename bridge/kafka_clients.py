"""Kafka clients built from the config: every client gets `kafka.client` passed through to librdkafka."""

from __future__ import annotations

import hashlib
import logging
import socket
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic  # type: ignore[attr-defined]

from bridge.config import BridgeConfig

# librdkafka's own log lines (connection refused, rebalances) go through Python logging, as the bridge's JSON
# lines do, not raw `%6|…|BGQUEUE|…` text on stderr. They are served when the client is polled (the bridge polls
# every client it keeps).
KAFKA_LOG = logging.getLogger("rdq.kafka")


def _base(config: BridgeConfig) -> dict[str, Any]:
    return {"bootstrap.servers": config.kafka.bootstrap_servers, "logger": KAFKA_LOG, **config.kafka.client}


def producer_config(config: BridgeConfig, **overrides: Any) -> dict[str, Any]:
    # Idempotence implies acks=all and ordered, de-duplicated retries: what the DLQ outbox relies on.
    return {**_base(config), "enable.idempotence": True, "acks": "all", "linger.ms": 5, **config.kafka.producer,
            **overrides}


FETCH_QUEUE_BACKOFF_MS = 20


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
        # A rebalance is noticed at a member's next heartbeat, and a cooperative one takes two rounds: at Kafka's
        # 3 s a `processes: 2` restart formed its group 6.7 s after it started (the first child holding, and
        # restoring, every partition meanwhile), at 500 ms 1.7 s (bench_processes restore, a 3,000-task changelog).
        "heartbeat.interval.ms": 500,
        # Half of the fetched-records budget (the bridge's backlog has the other half, SPEC §5.2).
        "queued.max.messages.kbytes": max(1024, int(config.kafka.max_buffered_mb * 1024 / 2)),
        # When that queue is full librdkafka waits fetch.queue.backoff.ms (default 1 s) before fetching again: on a
        # backlog the consumer then drains the queue and sits idle for most of the second (measured: a bare loop
        # at 56k records/s against 180k/s with 20 ms, bench/RESULTS.md). 20 ms keeps the queue topped up.
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        # With the changelog, offsets are committed only in its transactions (with the tasks they depend on).
        **({"enable.auto.commit": False} if config.store.changelog else {}),
        **config.kafka.consumer,
        **overrides,
    }


def make_producer(config: BridgeConfig, **overrides: Any) -> Producer:
    return Producer(producer_config(config, **overrides))


def make_dlq_producer(config: BridgeConfig, batch_bytes: int) -> Producer:
    return make_producer(config, **{"message.max.bytes": config.kafka.dlq_max_message_bytes,
                                    "batch.size": batch_bytes})


def transactional_id(config: BridgeConfig) -> str:
    """Stable across restarts of one instance: `engine.instance_id` if set, else this host and store file. A
    restarted instance then aborts its predecessor's open transaction at once (init_transactions fences it);
    with a new id (a new host, a fresh volume) the broker aborts it after `transaction.timeout.ms`, and restores
    of the partitions it wrote wait until then."""
    identity = config.engine.instance_id
    if identity is None:
        where = hashlib.sha256(str(config.store.path.resolve()).encode()).hexdigest()[:12]
        identity = f"{socket.gethostname()}-{where}"
    return f"rdq-{config.kafka.group_id}-{identity}"


def make_changelog_producer(config: BridgeConfig, batch_bytes: int) -> Producer:
    """The transactional producer of the changelog, the DLQ and the source offsets (SPEC §10)."""
    return Producer(changelog_producer_config(config, batch_bytes))


def changelog_producer_config(config: BridgeConfig, batch_bytes: int) -> dict[str, Any]:
    # lz4 unless `kafka.producer` says otherwise: a changelog record is JSON that repeats its keys, and on the
    # failure path the broker's share of the machine is the bridge's loss (bench_kafka failure, alternated on
    # 2026-12-05: 0.48, 0.53, 0.49 of executemany uncompressed against 0.53, 0.52, 0.53). Every Kafka client
    # reads lz4 batches; a record's size limits are checked before compression, as before.
    chosen = {"compression.type", "compression.codec"} & set(config.kafka.producer)
    compression = {} if chosen else {"compression.type": "lz4"}
    return producer_config(config, **compression, **{
        "transactional.id": transactional_id(config),
        "transaction.timeout.ms": 10_000,
        "message.max.bytes": config.kafka.dlq_max_message_bytes,
        "batch.size": batch_bytes,
    })


def make_restore_consumer(config: BridgeConfig, instance_id: str, committed_only: bool = True,
                          probe: bool = False) -> Consumer:
    """Reads changelog partitions by assignment (no group), committed transactions only (`committed_only=False`:
    to ask a partition's high watermark). `probe`: to read a record or two past a stalled partition's position,
    with fetches of a few records, not the restore's 64 MiB."""
    isolation = "read_committed" if committed_only else "read_uncommitted"
    # Measured (bench_changelog restore, 300k tasks over 12 partitions): with fetches of 64 MiB (16 a partition)
    # and librdkafka's 64 MiB queue the restoring process peaked at 1,197 MiB; with 4 MiB (1 a partition, a 4 MiB
    # queue) at 384 MiB, and restored faster (14,569 against 9,858 tasks/s: smaller batches overlap better). With
    # 1 MiB (256 KiB a partition, a 1 MiB queue) and batches of 1,000 records (restore.py) the peak of 200k tasks
    # over 12 partitions fell from 331 to 140 MiB at the same rate (bench/RESULTS.md, 2026-12-04). The queue's
    # size counts fetched bytes: a compressed changelog (lz4 in the bench) is several times that once decoded.
    fetch = {"fetch.max.bytes": 1024 * 1024, "max.partition.fetch.bytes": 64 * 1024,
             "queued.max.messages.kbytes": 1024} if probe else {
        "fetch.max.bytes": 1024 * 1024, "max.partition.fetch.bytes": 256 * 1024,
        "queued.max.messages.kbytes": 1024}
    return Consumer({**_base(config), "group.id": f"rdq-restore-{instance_id}", "enable.auto.commit": False,
                     "isolation.level": isolation, "enable.partition.eof": True,
                     "auto.offset.reset": "earliest", **fetch, "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS})


def make_consumer(config: BridgeConfig, **overrides: Any) -> Consumer:
    return Consumer(consumer_config(config, **overrides))


def make_admin_consumer(config: BridgeConfig, instance_id: str) -> Consumer:
    """Reads the admin topic by assignment: no group is joined, so every instance sees every command."""
    return Consumer({**_base(config), "group.id": f"rdq-admin-{instance_id}", "enable.auto.commit": False,
                     "auto.offset.reset": "latest"})


def make_admin(config: BridgeConfig) -> AdminClient:
    return AdminClient(_base(config))


DEFAULT_TOPIC_LIMIT = 1_048_588  # the broker's default max.message.bytes
_BATCH_MAX = 1_000_000


def topic_max_message_bytes(admin: AdminClient, topic: str) -> int:
    """A topic's max.message.bytes (the default when it cannot be read: the limit is an optimisation, the broker
    still refuses what is too big)."""
    try:
        resource = ConfigResource("topic", topic)
        configs = admin.describe_configs([resource])[resource].result(10)
        return int(configs["max.message.bytes"].value)
    except Exception as e:
        logging.getLogger(__name__).warning("cannot read max.message.bytes of %s (assuming %d): %s", topic,
                                            DEFAULT_TOPIC_LIMIT, e)
        return DEFAULT_TOPIC_LIMIT


def dlq_batch_bytes(limits: list[int]) -> int:
    """The broker checks a topic's max.message.bytes against a whole batch: a producer of DLQ records (the DLQ
    publisher's, the changelog's) never batches past the smallest DLQ topic's limit."""
    return min([_BATCH_MAX, *limits])


def ensure_topics(config: BridgeConfig, timeout: float = 30.0) -> list[str]:
    """Create the config's topics that are missing. Returns the names created."""
    admin = make_admin(config)
    existing = set(admin.list_topics(timeout=timeout).topics)
    wanted = [t for t in config.topics() if t not in existing]
    created = _create(config, admin, wanted, timeout) if wanted else []
    if config.store.changelog:
        from bridge.changelog.topics import ensure_changelogs

        before = set(admin.list_topics(timeout=timeout).topics)
        created += [t for t in ensure_changelogs(config, admin, timeout).values() if t not in before]
    return created


def _create(config: BridgeConfig, admin: AdminClient, wanted: list[str], timeout: float) -> list[str]:
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


def partition_count(config: BridgeConfig, topic: str, timeout: float = 10.0) -> int | None:
    """How many partitions `topic` has now; None when it does not exist."""
    admin = make_admin(config)
    deadline = time.monotonic() + timeout
    while True:
        metadata = admin.list_topics(timeout=timeout).topics.get(topic)
        if metadata is None or (metadata.error is not None
                                and metadata.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
            return None
        if metadata.partitions:  # another error (a leader election) still lists the partitions
            return len(metadata.partitions)
        if time.monotonic() > deadline:
            raise KafkaException(metadata.error or KafkaError(KafkaError._TIMED_OUT, f"no metadata for {topic}"))
        time.sleep(0.2)


def read_record(config: BridgeConfig, topic: str, partition: int, offset: int, timeout: float = 10.0) -> bytes | None:
    """The value of one record (e.g. a DLQ record to redrive from), or None when there is no such record."""
    consumer = Consumer({**_base(config), "group.id": f"rdq-reader-{uuid.uuid4().hex}", "enable.auto.commit": False,
                         "fetch.max.bytes": 64 * 1024 * 1024, "max.partition.fetch.bytes": 64 * 1024 * 1024})
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout)
        if not low <= offset < high:
            return None
        consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None and msg.offset() == offset:
                value: bytes | None = msg.value()
                return value
        return None
    finally:
        consumer.close()


def read_range(config: BridgeConfig, topic: str, partition: int, start: int, end: int,
               timeout: float = 30.0) -> list[Any]:
    """The records of one partition with offsets in [start, end) that still exist (compaction and retention may
    have removed some), as confluent-kafka messages. Raises KafkaException when the range cannot be read in time."""
    consumer = Consumer({**_base(config), "group.id": f"rdq-reader-{uuid.uuid4().hex}", "enable.auto.commit": False,
                         "fetch.max.bytes": 64 * 1024 * 1024, "max.partition.fetch.bytes": 64 * 1024 * 1024})
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout)
        start, end = max(start, low), min(end, high)
        if start >= end:
            return []
        consumer.assign([TopicPartition(topic, partition, start)])
        records: list[Any] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.5):
                error = msg.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(error)
                offset = msg.offset() or 0
                if offset < end:
                    records.append(msg)
                if offset >= end - 1:
                    return records
            position = consumer.position([TopicPartition(topic, partition)])[0].offset or 0
            if position >= end:  # the last offsets were gaps (transaction markers, compacted away)
                return records
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"{topic}/{partition}: [{start}, {end}) not read "
                                                               f"within {timeout:.0f}s"))
    finally:
        consumer.close()
