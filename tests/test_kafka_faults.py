"""What the Kafka path survives: SIGKILL at random moments, a handler that kills its process, the broker going
away and coming back, a second bridge joining and leaving. Every produced record is accounted for: a success
(counted through RDQ_EXAMPLE_LOG) or a DLQ record; none missing. Duplicates (at-least-once) are counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from bridge.kafka_clients import ensure_topics
from localkafka import LocalBroker
from tests.conftest import KafkaEnv
from tests.kafka_helpers import (
    BridgeProcess,
    account,
    aread_dlq,
    example_log,
    kafka_config,
    produce,
    running_bridge,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def mixed_payloads(n: int, rng: random.Random, dead_share: float = 0.05, transient_share: float = 0.3) -> list[bytes]:
    """ok on first delivery, transient (fails 1-2 times, then succeeds), or hopeless (→ DLQ)."""
    out = []
    for _ in range(n):
        roll = rng.random()
        fail = 99 if roll < dead_share else rng.randint(1, 2) if roll < dead_share + transient_share else 0
        out.append(json.dumps({"fail": fail}).encode())
    return out


def produce_slowly(config: object, topic: str, payloads: list[bytes], per_second: int) -> None:
    for start in range(0, len(payloads), per_second // 10):
        chunk = payloads[start : start + per_second // 10]
        produce(config, topic, [(f"k{start + i}".encode(), p, []) for i, p in enumerate(chunk)])  # type: ignore[arg-type]
        time.sleep(0.1)


def wait_accounted(check: object, within: float, every: float = 1.0) -> object:
    deadline = time.monotonic() + within
    while True:
        result = check()  # type: ignore[operator]
        if not result.missing or time.monotonic() > deadline:
            return result
        time.sleep(every)


def test_sigkill_at_random_moments_loses_nothing(kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    rng = random.Random(4242)
    topic, dlq = f"in-{unique}", f"dlq-{unique}"
    log_path = tmp_path / "example.log"
    # Static membership: a restarted bridge takes its partitions back at once instead of waiting out the
    # session of the one that was killed (how a sidecar with a stable identity should run).
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "mixed": {"handler": "flaky", "sources": [topic], "dlq_topic": dlq, "max_attempts": 4, "lease": "3s",
                  "backoff": {"kind": "fixed", "base": "50ms"}}},
        kafka={"consumer": {"group.instance.id": f"bridge-{unique}", "session.timeout.ms": 10000}})
    ensure_topics(config)
    payloads = mixed_payloads(3000, rng)
    # Records keep arriving (~200/s) while the bridge is killed, so kills land mid-work.
    feeder = threading.Thread(target=produce_slowly, args=(config, topic, payloads, 200))
    feeder.start()
    bridge = BridgeProcess(config, tmp_path / "bridge.yaml", {"RDQ_EXAMPLE_LOG": str(log_path)})
    kills = 6
    for _ in range(kills):
        bridge.start()
        time.sleep(rng.uniform(1.5, 4.0))
        assert bridge.alive, bridge.tail()
        bridge.kill()
    bridge.start()
    feeder.join()
    try:
        result = wait_accounted(lambda: account(config, log_path, topic, dlq, len(payloads)), within=180)
    finally:
        assert bridge.terminate() == 0, bridge.tail()
    print(f"\nSIGKILL x{kills}: {result.summary()}")  # type: ignore[attr-defined]
    runs_with_work = bridge.log.read_text().count("assigned [")
    assert runs_with_work >= kills // 2, "most runs should have been assigned partitions before their kill"
    assert not result.missing, f"lost: {sorted(result.missing)[:10]}"  # type: ignore[attr-defined]
    hopeless = sum(1 for p in payloads if b"99" in p)
    assert len(set(result.dead)) >= hopeless  # type: ignore[attr-defined]


def test_a_handler_that_kills_its_process_ends_in_the_dlq(kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """Poison pill: first delivery kills the bridge; after restarts it is a task whose LEASE_EXPIRED attempts
    count against max_attempts, and it reaches the DLQ."""
    topic, dlq = f"in-{unique}", f"dlq-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "crashy": {"handler": "crash", "sources": [topic], "dlq_topic": dlq, "max_attempts": 3, "lease": "1s",
                   "backoff": {"kind": "fixed", "base": "10ms"}}})
    ensure_topics(config)
    # Three poison pills in one partition, from its very first offset (offset 0 must be journaled too).
    produce(config, topic, [(b"poison", f'{{"n": {i}}}'.encode(), []) for i in range(3)])
    bridge = BridgeProcess(config, tmp_path / "bridge.yaml")
    records: list = []
    deadline = time.monotonic() + 240
    while len(records) < 3 and time.monotonic() < deadline:
        if not bridge.alive:
            assert bridge.starts < 20, f"still {len(records)} DLQ records after {bridge.starts} starts"
            bridge.start()
        records = asyncio.run(aread_dlq(kafka.bootstrap_servers, dlq, settle=1.0, timeout=3.0))
    bridge.terminate()
    assert len(records) == 3, bridge.tail()
    for record in records:
        assert [a["outcome"] for a in record.value["attempts"]] == ["LEASE_EXPIRED"] * 3
        assert record.value["reason"]["type"] == "rdq.LeaseExpired" and record.key == b"poison"
    assert sorted(r.source for r in records) == [f"kafka://{topic}/{records[0].source.split('/')[3]}/{i}"
                                                 for i in range(3)]
    assert bridge.starts >= 4  # it killed the bridge on its runs


def test_records_in_flight_at_a_kill_are_retried_not_dead_lettered_with_max_attempts_1(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """max_attempts 1, one record at a time, SIGKILL once all 30 are journaled: the 30 records come back as
    suspects, most of them never begun (the journal holds a poll's range, not what started). Each is stored with
    its LEASE_EXPIRED attempt uncounted (it would have been its last), retried, and succeeds: none is
    dead-lettered without a run that surely began (before, all 30 went to the DLQ unrun)."""
    import sqlite3

    from bridge.source.first_delivery import SUSPECT_NOTE

    topic, dlq = f"in-{unique}", f"dlq-{unique}"
    log_path = tmp_path / "example.log"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "once": {"handler": "flaky", "sources": [topic], "dlq_topic": dlq, "max_attempts": 1,
                 "backoff": {"kind": "fixed", "base": "50ms"}}},
        kafka={"topic_partitions": 1, "partition_concurrency": 1})
    ensure_topics(config)
    produce(config, topic, [(b"k", json.dumps({"ms": 3000 if i == 0 else 0}).encode(), []) for i in range(30)])
    bridge = BridgeProcess(config, tmp_path / "bridge.yaml", {"RDQ_EXAMPLE_LOG": str(log_path)}).start()
    store = config.store.path

    def journaled() -> int:
        """The highest offset journaled (polls grow 4, 16, 64: the first alone covers 4 of the 30)."""
        if not store.exists():
            return -1
        with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)) as db:
            try:
                return int(db.execute("SELECT coalesce(max(hi), -1) FROM inflight").fetchone()[0])
            except sqlite3.OperationalError:  # not migrated yet
                return -1

    deadline = time.monotonic() + 60
    while journaled() < 29 and time.monotonic() < deadline:
        assert bridge.alive, bridge.tail()
        time.sleep(0.02)
    bridge.kill()  # within the first record's 3 s: the other 29 have not begun
    assert not example_log(log_path), "a record finished before the kill: the test did not catch a poll in flight"
    bridge.start()
    try:
        result = wait_accounted(lambda: account(config, log_path, topic, dlq, 30), within=120)
        # Read while it runs: a stop hands the partition over and empties this file.
        with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)) as db:
            uncounted = db.execute("SELECT count(DISTINCT task_id) FROM attempts WHERE note = ? AND outcome = ?",
                                   (SUSPECT_NOTE, "LEASE_EXPIRED")).fetchone()[0]
            counts = {row[0]: row[1] for row in db.execute(
                "SELECT attempt_count || ' ' || status, count(*) FROM tasks GROUP BY 1")}
    finally:
        assert bridge.terminate() == 0, bridge.tail()
    assert not result.missing, f"lost: {sorted(result.missing)[:5]}"  # type: ignore[attr-defined]
    assert not result.dead, f"dead-lettered: {sorted(result.dead)[:5]}"  # type: ignore[attr-defined]
    assert uncounted == 30 and counts == {"1 SUCCEEDED": 30}, (uncounted, counts)  # one counted attempt: the run


async def test_broker_down_and_back_loses_nothing_without_a_restart(tmp_path: Path, unique: str,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    stoppable_broker: LocalBroker) -> None:
    log_path = tmp_path / "example.log"
    monkeypatch.setenv("RDQ_EXAMPLE_LOG", str(log_path))
    broker = stoppable_broker
    try:
        topic, dlq = f"in-{unique}", f"dlq-{unique}"
        config = kafka_config(broker.bootstrap_servers, tmp_path, unique, {
            "mixed": {"handler": "flaky", "sources": [topic], "dlq_topic": dlq, "max_attempts": 3,
                      "backoff": {"kind": "fixed", "base": "500ms"}}})
        rng = random.Random(7)
        first, second = mixed_payloads(400, rng, 0.1), mixed_payloads(400, rng, 0.1)
        async with running_bridge(config):
            produce(config, topic, [(None, p, []) for p in first])
            await asyncio.sleep(1.0)  # mid-run: some done, retries pending, DLQ records on their way
            await asyncio.to_thread(broker.stop)
            await asyncio.sleep(12)
            await asyncio.to_thread(broker.start)
            produce(config, topic, [(None, p, []) for p in second])
            total = len(first) + len(second)
            result = await asyncio.to_thread(
                wait_accounted, lambda: account(config, log_path, topic, dlq, total), 120)
        print(f"\nbroker down 12 s: {result.summary()}")  # type: ignore[attr-defined]
        assert not result.missing  # type: ignore[attr-defined]
    finally:
        await asyncio.to_thread(broker.start)  # running again for the tests after this one (a no-op if it runs)


def test_a_second_bridge_joining_and_leaving_loses_nothing(kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    topic, dlq = f"in-{unique}", f"dlq-{unique}"
    log_path = tmp_path / "example.log"
    queues = {"mixed": {"handler": "flaky", "sources": [topic], "dlq_topic": dlq, "max_attempts": 3,
                        "backoff": {"kind": "fixed", "base": "100ms"}}}
    config_a = kafka_config(kafka.bootstrap_servers, tmp_path / "a", unique, queues)
    config_b = kafka_config(kafka.bootstrap_servers, tmp_path / "b", unique, queues)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    ensure_topics(config_a)
    payloads = mixed_payloads(3000, random.Random(11))
    env = {"RDQ_EXAMPLE_LOG": str(log_path)}
    a = BridgeProcess(config_a, tmp_path / "a" / "bridge.yaml", env).start()
    b = BridgeProcess(config_b, tmp_path / "b" / "bridge.yaml", env)
    feeder = threading.Thread(target=produce_slowly, args=(config_a, topic, payloads, 200))
    try:
        feeder.start()
        time.sleep(2)
        b.start()
        time.sleep(7)
        assert b.terminate() == 0, b.tail()  # leaves the group: its partitions move back to A
        assert "assigned [" in b.log.read_text(), "B should have taken partitions while it was in the group"
        time.sleep(2)
        b.start()  # its store's pending retries run when it comes back (one store per instance)
        feeder.join()
        result = wait_accounted(lambda: account(config_a, log_path, topic, dlq, len(payloads)), within=180)
    finally:
        assert a.terminate() == 0, a.tail()
        b.terminate()
    print(f"\njoin and leave: {result.summary()}")  # type: ignore[attr-defined]
    assert not result.missing  # type: ignore[attr-defined]
    assert example_log(log_path)


def test_sigquit_prints_every_threads_stack_and_the_bridge_runs_on(kafka: KafkaEnv, tmp_path: Path,
                                                                  unique: str) -> None:
    """A bridge that will not stop can be asked where it is stuck: `kill -QUIT` writes each thread's stack to
    stderr (the harness prints it when a terminate times out) and the bridge goes on working."""
    topic, dlq = f"in-{unique}", f"dlq-{unique}"
    log_path = tmp_path / "example.log"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "mixed": {"handler": "flaky", "sources": [topic], "dlq_topic": dlq}})
    ensure_topics(config)
    bridge = BridgeProcess(config, tmp_path / "bridge.yaml", {"RDQ_EXAMPLE_LOG": str(log_path)}).start()
    try:
        deadline = time.monotonic() + 60
        while not bridge.started() and time.monotonic() < deadline:
            time.sleep(0.1)
        bridge.proc.send_signal(signal.SIGQUIT)
        while b"Current thread" not in bridge.log.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.1)
        dump = bridge.log.read_text(errors="replace")
        assert "Current thread" in dump and 'File "' in dump, bridge.tail()
        assert "bridge/service.py" in dump or "asyncio" in dump, dump[-3000:]  # the event loop's thread is there
        produce(config, topic, [(b"k", b'{"fail": 0}', [])])
        while not log_path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert bridge.alive and log_path.exists(), bridge.tail()  # it handled a record after the dump
    finally:
        assert bridge.terminate() == 0, bridge.tail()
