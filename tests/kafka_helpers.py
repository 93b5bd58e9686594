"""Helpers for tests that run the bridge on a real broker: produce, read a DLQ, account for every record."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

import handlers  # noqa: F401 - the example handlers
from bridge.config import BridgeConfig, parse_config
from bridge.kafka_clients import ensure_topics
from bridge.registry import REGISTRY, Registry
from bridge.service import Bridge, open_bridge

Headers = list[tuple[str, bytes]]


def kafka_config(bootstrap: str, tmp_path: Path, unique: str, queues: dict[str, dict[str, Any]],
                 **extra: Any) -> BridgeConfig:
    """A config on the test broker with this test's own topics (suffixed), group and store."""
    tree: dict[str, Any] = {
        "kafka": {"bootstrap_servers": bootstrap, "group_id": f"g-{unique}", "topic_partitions": 3,
                  "consumer": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000}},
        "store": {"path": str(tmp_path / "rdq.db")},
        "queues": queues,
        "engine": {"sweep_interval": "100ms", "grace_period": "5s", "handler_modules": ["handlers"]},
    }
    for key, value in extra.items():
        tree[key] = {**tree.get(key, {}), **value}
    return parse_config(tree, "<test>")


def produce(config: BridgeConfig, topic: str, records: Iterable[tuple[bytes | None, bytes, Headers]],
            timestamp: int = 0) -> int:
    """`timestamp`: every record's, in ms (0: the producer's clock)."""
    producer = Producer({"bootstrap.servers": config.kafka.bootstrap_servers, "linger.ms": 5})
    n = 0
    for key, value, headers in records:
        producer.produce(topic, value=value, key=key, headers=headers, timestamp=timestamp)
        n += 1
        if n % 1000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0
    return n


@dataclass
class DlqRecord:
    key: bytes | None
    value: dict[str, Any]
    headers: dict[str, bytes]
    raw_headers: list[tuple[str, bytes]]
    partition: int
    offset: int

    @property
    def source(self) -> str:
        return self.headers["rdq.source"].decode()


def _fetching(consumer: Consumer, topic: str) -> bool:
    """The consumer has its partitions and a fetch answer for each (their cached watermarks are known): what
    they held is arriving. Or the topic is not there at all (nothing to wait for)."""
    assigned = consumer.assignment()
    if not assigned:
        metadata = consumer.list_topics(topic, timeout=10).topics.get(topic)
        return metadata is None or metadata.error is not None
    return all(consumer.get_watermark_offsets(tp, cached=True)[1] >= 0 for tp in assigned)


def read_topic(bootstrap: str, topic: str, settle: float = 2.0, timeout: float = 60.0,
               expect: int | None = None) -> list[Any]:
    """Every record of `topic` from the beginning: until `expect` are read, or nothing new for `settle` s once
    the consumer fetches (its group's join and first offset lookup can take longer than `settle`: counted from
    the start, a short settle read nothing — the nemesis waited 4 minutes for a DLQ that held every poison pill).
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "fetch.max.bytes": 64 * 1024 * 1024, "max.partition.fetch.bytes": 16 * 1024 * 1024})
    consumer.subscribe([topic])
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    quiet_since = time.monotonic()
    try:
        while time.monotonic() < deadline:
            got = [m for m in consumer.consume(500, 0.5) if m.error() is None]
            out += got
            if got or not _fetching(consumer, topic):
                quiet_since = time.monotonic()
            if expect is not None and len(out) >= expect and time.monotonic() - quiet_since > 0.5:
                break
            if expect is None and time.monotonic() - quiet_since > settle:
                break
    finally:
        consumer.close()
    return out


def read_dlq(bootstrap: str, topic: str, **kw: Any) -> list[DlqRecord]:
    return [DlqRecord(m.key(), json.loads(m.value()), dict(m.headers() or []), list(m.headers() or []),
                      m.partition(), m.offset()) for m in read_topic(bootstrap, topic, **kw)]


async def aread_dlq(bootstrap: str, topic: str, **kw: Any) -> list[DlqRecord]:
    """read_dlq off the event loop, so an in-process bridge keeps running meanwhile."""
    return await asyncio.to_thread(read_dlq, bootstrap, topic, **kw)


def example_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def committed_lag(config: BridgeConfig, topic: str) -> int:
    """How many records of `topic` are past the group's committed offsets (-1: the group cannot say yet)."""
    consumer = Consumer({"bootstrap.servers": config.kafka.bootstrap_servers, "group.id": config.kafka.group_id})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        tps = [TopicPartition(topic, p) for p in partitions]
        lag = 0
        try:
            committed = consumer.committed(tps, timeout=10)
        except KafkaException:  # e.g. the group's coordinator is still loading
            return -1
        for tp in committed:
            _, high = consumer.get_watermark_offsets(tp, timeout=10)
            lag += high - max(tp.offset, 0)
        return lag
    finally:
        consumer.close()


async def lag(config: BridgeConfig, topic: str) -> int:
    """committed_lag off the event loop."""
    return await asyncio.to_thread(committed_lag, config, topic)


async def await_lag(config: BridgeConfig, topic: str, expected: int, within: float = 30.0) -> None:
    async def reached() -> bool:
        return await lag(config, topic) == expected

    await wait_until(reached, within=within, interval=0.2, what=f"committed lag of {topic} to be {expected}")


@dataclass
class Accounting:
    produced: set[str]
    successes: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)

    @property
    def missing(self) -> set[str]:
        return self.produced - set(self.successes) - set(self.dead)

    @property
    def duplicate_successes(self) -> int:
        return len(self.successes) - len(set(self.successes))

    @property
    def duplicate_dead(self) -> int:
        return len(self.dead) - len(set(self.dead))

    def summary(self) -> str:
        return (f"records in {len(self.produced)}, successes {len(set(self.successes))}, DLQ {len(set(self.dead))}, "
                f"lost {len(self.missing)}, duplicate successes {self.duplicate_successes}, "
                f"duplicate DLQ {self.duplicate_dead}")


def sources_of(config: BridgeConfig, topic: str, count: int) -> set[str]:
    """The rdq.source of every record produced to a fresh topic: offsets are known per partition."""
    consumer = Consumer({"bootstrap.servers": config.kafka.bootstrap_servers, "group.id": "unused"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        out = set()
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            out |= {f"kafka://{topic}/{p}/{o}" for o in range(low, high)}
        assert len(out) == count, (len(out), count)
        return out
    finally:
        consumer.close()


def account(config: BridgeConfig, log_path: Path, topic: str, dlq_topic: str, produced: int,
            expect_dead: int | None = None) -> Accounting:
    result = Accounting(sources_of(config, topic, produced))
    result.successes = [line["source"] for line in example_log(log_path)]
    result.dead = [r.source for r in read_dlq(config.kafka.bootstrap_servers, dlq_topic, expect=expect_dead)]
    return result


def b64(data: str) -> bytes:
    return base64.b64decode(data)


@asynccontextmanager
async def running_bridge(config: BridgeConfig, registry: Registry | None = None, instance_id: str = "test-bridge",
                         telemetry: Any = None) -> AsyncIterator[Bridge]:
    ensure_topics(config)
    bridge = await open_bridge(config, registry or REGISTRY, instance_id=instance_id, telemetry=telemetry)
    store = bridge.store
    stop = asyncio.Event()
    runner = asyncio.create_task(bridge.run(stop))
    try:
        yield bridge
    finally:
        stop.set()
        await runner
        await store.close()


async def wait_until(predicate: Any, within: float = 60.0, interval: float = 0.1, what: str = "condition") -> None:
    deadline = time.monotonic() + within
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)


class BridgeHung(AssertionError):
    """A bridge process that did not stop after SIGTERM; the message holds its stacks and last log lines."""


class BridgeProcess:
    """`rdq run` as a child process, for tests that kill it."""

    def __init__(self, config: BridgeConfig, path: Path, env: dict[str, str] | None = None, name: str = "bridge"):
        import yaml

        self.path = path
        self.name = name
        path.write_text(yaml.safe_dump(config.file_tree()))
        self.env = {**__import__("os").environ, **(env or {})}
        self.proc: Any = None
        self.log = path.with_suffix(".log")
        self.starts = 0
        self._log_from = 0

    def start(self) -> BridgeProcess:
        import subprocess
        import sys

        self.starts += 1
        self._log_from = self.log.stat().st_size if self.log.exists() else 0  # this start's lines only
        out = self.log.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "bridge.cli", "run", "--config", str(self.path)],
                                     stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=Path(__file__).resolve().parent.parent)
        out.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def started(self) -> bool:
        """The bridge logged its start (its signal handlers are installed; a SIGTERM before that ends the process
        the default way, -15: a test race on a loaded machine, not a graceful stop to assert on)."""
        return self.log.exists() and b" started: store " in self.log.read_bytes()[self._log_from:]

    def terminate(self, timeout: float = 60) -> int:
        import signal
        import subprocess

        deadline = time.monotonic() + timeout
        while self.alive and not self.started() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
        if self.proc is None:
            return 0
        try:
            return int(self.proc.wait(timeout))
        except subprocess.TimeoutExpired:
            raise BridgeHung(self.hung_report(timeout)) from None

    def hung_report(self, timeout: float) -> str:
        """A bridge that did not stop: its threads' stacks (SIGQUIT, bridge/service.py) and its last log lines,
        then it is killed."""
        import signal

        self.proc.send_signal(signal.SIGQUIT)
        time.sleep(2)
        self.kill()
        return (f"the bridge did not stop within {timeout:.0f} s of SIGTERM; its stacks and last lines:\n"
                f"{self.tail(400)}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""
