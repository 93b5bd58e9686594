"""Shared fixtures. Kafka tests run against a real broker, chosen in this order:

1. KAFKA_BOOTSTRAP_SERVERS, when set;
2. testcontainers' Kafka module (apache/kafka image), when a Docker engine answers;
3. the repo's local broker tooling (`localkafka`: Kafka from Maven Central), otherwise.

If none can be had the run fails with the reason: a Kafka test is never skipped.
Tests don't leak into each other: each makes its own topics and consumer groups (`unique`).
`make test` runs two at a time (pytest-xdist): each worker is a session of its own, so it starts a broker of its
own (or shares the KAFKA_BOOTSTRAP_SERVERS one, topics and groups apart).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from bridge.config import BridgeConfig, parse_config
from localkafka import BrokerError, LocalBroker

KAFKA_IMAGE = "apache/kafka:4.4.0"


@dataclass
class KafkaEnv:
    bootstrap_servers: str
    how: str
    broker: LocalBroker | None = None  # set when this run owns a local broker (tests may stop/start it)


def _docker_engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        proc = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and bool(proc.stdout.strip())


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaEnv]:
    configured = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if configured:
        yield KafkaEnv(configured, "KAFKA_BOOTSTRAP_SERVERS")
        return
    if _docker_engine_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer(KAFKA_IMAGE).with_kraft() as container:
            yield KafkaEnv(container.get_bootstrap_server(), f"testcontainers {KAFKA_IMAGE}")
        return
    broker = LocalBroker(tmp_path_factory.mktemp("kafka"))
    try:
        broker.start()
    except BrokerError as e:
        pytest.fail(f"no Kafka broker: KAFKA_BOOTSTRAP_SERVERS is unset, no Docker engine answers, and the local "
                    f"broker failed: {e}", pytrace=False)
    try:
        yield KafkaEnv(broker.bootstrap_servers, "localkafka", broker)
    finally:
        broker.stop()


@pytest.fixture
def stoppable_broker(kafka: KafkaEnv, tmp_path: Path) -> Iterator[LocalBroker]:
    """A broker this test may stop and start (an outage): always a local broker of the test's own. (Stopping the
    suite's shared Kafka 4.4 broker, which by then holds every earlier test's topics, made its restart and the
    test's recovery outlast the test's timeout in a full run; alone, the same test passed in 36 s.)"""
    broker = LocalBroker(tmp_path / "kafka")
    try:
        broker.start()
    except BrokerError as e:
        pytest.fail(f"a broker outage test needs a broker it may stop; the local broker failed: {e}", pytrace=False)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def unique() -> str:
    """A suffix for this test's topics and groups."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def example_log_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """RDQ_EXAMPLE_LOG for this test: the example handlers append a line per success."""
    path = tmp_path / "example.log"
    monkeypatch.setenv("RDQ_EXAMPLE_LOG", str(path))
    return path


def write_config(path: Path, tree: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


@pytest.fixture
def bridge_config(kafka: KafkaEnv, tmp_path: Path, unique: str) -> BridgeConfig:
    """A two-queue config on the test broker with this test's own topics, group and store."""
    tree = {
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers, "group_id": f"g-{unique}", "topic_partitions": 2},
        "store": {"path": str(tmp_path / "rdq.db")},
        "queues": {
            "orders.process": {"handler": "flaky", "sources": [f"orders-{unique}"], "max_attempts": 3,
                               "backoff": {"kind": "fixed", "base": "10ms"}, "dlq_topic": f"orders-{unique}.dlq"},
            # Its own DLQ name too: the default (`payments.charge.dlq`) would be one topic for every test on a broker.
            "payments.charge": {"handler": "ok", "sources": [f"payments-{unique}"],
                                "dlq_topic": f"payments-{unique}.dlq"},
        },
        "admin": {"topic": f"admin-{unique}", "reply_topic": f"replies-{unique}",
                  "auth": {"keys": {"k1": "a-test-secret-of-32-bytes-or-more"}}},
    }
    return parse_config(tree, "<test>")
