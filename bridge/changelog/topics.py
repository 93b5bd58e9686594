"""Changelog topics (SPEC §10): one per source topic, compacted, co-partitioned, created when missing.

A changelog that exists with the wrong partition count or without compaction is refused, naming the topic and
the fix: writing tasks to the wrong partitions, or letting retention delete them, would lose them.
"""

from __future__ import annotations

import time

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic  # type: ignore[attr-defined]

from bridge.config import BridgeConfig


class ChangelogTopicError(RuntimeError):
    """A changelog topic the bridge must not use as it is."""


def changelog_settings(config: BridgeConfig) -> dict[str, str]:
    # A task with its history can be as large as its DLQ record: the same limit (the DLQ's trimming rules apply
    # to a task that would not fit).
    return {"cleanup.policy": "compact", "max.message.bytes": str(config.kafka.dlq_max_message_bytes)}


def source_partitions(admin: AdminClient, topics: list[str], timeout: float) -> dict[str, int]:
    metadata = admin.list_topics(timeout=timeout).topics
    return {t: len(metadata[t].partitions) for t in topics if t in metadata and metadata[t].error is None}


def ensure_changelogs(config: BridgeConfig, admin: AdminClient, timeout: float = 30.0) -> dict[str, str]:
    """Create the missing changelog topics (partitions = the source's), check the others. Returns
    {source topic: changelog topic}. Raises ChangelogTopicError for one that exists but is wrong."""
    _await_metadata(admin, config.source_topics(), min(timeout, 5.0))  # just created by `rdq topics`?
    sources = source_partitions(admin, config.source_topics(), timeout)
    existing = admin.list_topics(timeout=timeout).topics
    wanted = {config.changelog_topic(t): n for t, n in sources.items()}
    missing = [NewTopic(name, num_partitions=n, replication_factor=config.kafka.topic_replication_factor,
                        config=changelog_settings(config))
               for name, n in wanted.items() if name not in existing]
    if missing:
        for _topic, future in admin.create_topics(missing, operation_timeout=timeout).items():
            try:
                future.result(timeout)
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
        _await_metadata(admin, [t.topic for t in missing], timeout)
    check_changelogs(config, admin, sources, timeout)
    return {t: config.changelog_topic(t) for t in sources}


def _await_metadata(admin: AdminClient, names: list[str], timeout: float) -> None:
    """A topic just created may take a moment to show in the metadata."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        topics = admin.list_topics(timeout=timeout).topics
        if all(n in topics and topics[n].partitions for n in names):
            return
        time.sleep(0.1)


def check_changelogs(config: BridgeConfig, admin: AdminClient, sources: dict[str, int], timeout: float) -> None:
    metadata = admin.list_topics(timeout=timeout).topics
    for source, partitions in sources.items():
        name = config.changelog_topic(source)
        topic = metadata.get(name)
        if topic is None:
            raise ChangelogTopicError(f"changelog topic {name} of {source} does not exist")
        if len(topic.partitions) != partitions:
            raise ChangelogTopicError(
                f"changelog topic {name} has {len(topic.partitions)} partitions but its source {source} has "
                f"{partitions}: tasks would go to the wrong partitions. Delete {name} (its tasks are lost unless "
                f"restored by a bridge first) or give {source} and {name} the same partition count")
        resource = ConfigResource("topic", name)
        policy = admin.describe_configs([resource])[resource].result(timeout)["cleanup.policy"].value
        if "compact" not in policy:
            raise ChangelogTopicError(
                f"changelog topic {name} has cleanup.policy={policy}: retention would delete open tasks. "
                f"Set it with: kafka-configs --alter --entity-type topics --entity-name {name} "
                f"--add-config cleanup.policy=compact")
