"""Tasks outlive their bridge (SPEC §10), against a real broker with several bridge processes.

Scale-down, a lost disk, a zombie (SIGSTOP) and the changelog's own faults: a corrupt record, a wrong topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bridge.changelog.codec import SCHEMA
from bridge.changelog.local import HomeState, LocalIndex
from bridge.changelog.topics import ChangelogTopicError, ensure_changelogs
from bridge.changelog.writer import ChangelogWriter
from bridge.config import BridgeConfig, parse_config
from bridge.kafka_clients import ensure_topics, make_changelog_producer, make_consumer
from bridge.store.tasks import Store
from tests.helpers import failure
from tests.kafka_helpers import (
    BridgeProcess,
    account,
    committed_lag,
    example_log,
    kafka_config,
    produce,
    read_dlq,
    read_topic,
    running_bridge,
    wait_until,
)

pytestmark = pytest.mark.kafka


def config_for(kafka: Any, tmp_path: Path, unique: str, partitions: int = 6, **queue: Any) -> BridgeConfig:
    # The breaker is off: these records fail their first attempts by number (`flaky`, {"fail": 2}), so the wave of
    # retries a survivor restores after a hand-over all fail at once — to a breaker, an outage (README: "The
    # circuit breaker"). These tests are about where tasks live, not about outages.
    return kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "flaky", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}",
              "breaker": {"enabled": False}, **queue}},
        kafka={"topic_partitions": partitions})


def instance(config: BridgeConfig, tmp_path: Path, name: str, log: Path) -> BridgeProcess:
    """One bridge process of the group: its own store directory and instance id."""
    tree = config.file_tree()
    (tmp_path / name).mkdir(exist_ok=True)
    tree["store"]["path"] = str(tmp_path / name / "rdq.db")
    tree.setdefault("engine", {})["instance_id"] = name
    return BridgeProcess(parse_config(tree, "<test>"), tmp_path / f"{name}.yaml", {"RDQ_EXAMPLE_LOG": str(log)},
                         name=name)


def store_rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows of `sql` in a bridge's store; none while the file or its schema is not there yet (a starting bridge
    creates the file a moment before its tables, and a test polling it may look in between)."""
    if not db.exists():
        return []
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'tasks'").fetchone():
            return []
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def open_tasks(db: Path) -> int:
    rows = store_rows(db, "SELECT COUNT(*) FROM tasks WHERE status IN ('PENDING', 'IN_FLIGHT')")
    return int(rows[0][0]) if rows else 0


def changelog_states(config: BridgeConfig, topic: str) -> dict[str, dict[str, Any]]:
    """The last committed changelog record of every task (read_committed: aborted writes are not seen)."""
    last: dict[str, dict[str, Any]] = {}
    for msg in read_topic(config.kafka.bootstrap_servers, config.changelog_topic(topic), settle=2.0):
        key = msg.key().decode()
        if msg.value() is None:
            last.pop(key, None)
        else:
            last[key] = json.loads(msg.value())
    return last


def payloads(n: int, failing_every: int = 3, fail: int = 2, **extra: Any) -> list[tuple[bytes, bytes, list[Any]]]:
    return [(f"k{i}".encode(), json.dumps({"fail": fail if i % failing_every == 0 else 0, "i": i, **extra}).encode(),
             []) for i in range(n)]


@pytest.mark.slow
def test_scale_down_every_record_ends_once_on_the_survivor(kafka: Any, tmp_path: Path) -> None:
    """3 bridges, 3,000 records (a third fail twice, 3 s backoff: tasks are open), two stopped with SIGTERM:
    every record ends as exactly one success, on the survivor for the moved tasks; nothing stays open."""
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, backoff={"kind": "fixed", "base": "3s"}, max_attempts=5)
    ensure_topics(config)
    log = tmp_path / "example.log"
    bridges = [instance(config, tmp_path, f"b{i}", log).start() for i in range(3)]
    try:
        n = 3000
        produce(config, f"in-{unique}", payloads(n))
        dbs = [tmp_path / f"b{i}" / "rdq.db" for i in range(3)]
        # The two to go hold open tasks (a third of their records fail and wait 3 s).
        wait_until_sync(lambda: open_tasks(dbs[1]) > 0 and open_tasks(dbs[2]) > 0, 90, "tasks open on b1 and b2")
        for b in bridges[1:]:
            assert b.terminate(60) == 0, b.tail()
        for db in dbs[1:]:  # handed over: nothing of theirs is left in their files
            assert store_rows(db, "SELECT COUNT(*) FROM tasks")[0][0] == 0
        wait_until_sync(lambda: not account(config, log, f"in-{unique}", f"dlq-{unique}", n).missing, 120,
                        "every record done")
        result = account(config, log, f"in-{unique}", f"dlq-{unique}", n)
        assert not result.missing and not result.dead, result.summary()
        assert result.duplicate_successes == 0, result.summary()
        wait_until_sync(lambda: open_tasks(dbs[0]) == 0, 30, "nothing open on the survivor")
        moved = [e for e in example_log(log) if e["attempt"] == 3]
        assert len(moved) == n // 3 + (1 if n % 3 else 0)  # every failing record succeeded at its 3rd attempt
    finally:
        for b in bridges:
            b.kill()


@pytest.mark.slow
def test_a_lost_disk_loses_no_task_and_keeps_attempts_counted(kafka: Any, tmp_path: Path) -> None:
    """2 bridges; SIGKILL one and delete its store: the other finishes its tasks with their history: attempt
    numbers continue and max_attempts counts the attempts made before the move."""
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, backoff={"kind": "fixed", "base": "4s"}, max_attempts=3)
    ensure_topics(config)
    log = tmp_path / "example.log"
    a, b = instance(config, tmp_path, "a", log).start(), instance(config, tmp_path, "b", log).start()
    try:
        n = 300
        # Every 3rd record fails twice (succeeds at attempt 3); every 10th always fails (DEAD after 3).
        records = [(k, json.dumps({"fail": 99 if i % 10 == 0 else 2 if i % 3 == 0 else 0}).encode(), h)
                   for i, (k, _, h) in enumerate(payloads(n))]
        produce(config, f"in-{unique}", records)
        db_a = tmp_path / "a" / "rdq.db"
        wait_until_sync(lambda: open_tasks(db_a) >= 20, 60, "tasks open on bridge a")
        time.sleep(0.5)  # their changelog transaction (every 100 ms)
        a.kill()
        for leftover in (tmp_path / "a").iterdir():
            leftover.unlink()
        dead = sum(1 for i in range(n) if i % 10 == 0)
        wait_until_sync(lambda: not account(config, log, f"in-{unique}", f"dlq-{unique}", n, dead).missing, 120,
                        "every record done")
        result = account(config, log, f"in-{unique}", f"dlq-{unique}", n, dead)
        assert not result.missing and result.duplicate_dead == 0, result.summary()
        assert len(set(result.dead)) == dead
        for record in read_dlq(kafka.bootstrap_servers, f"dlq-{unique}", expect=dead):
            assert [x["attempt_no"] for x in record.value["attempts"] if x["redrive_no"] == 0][:3] == [1, 2, 3]
            assert record.value["task"]["attempt_count"] == 3  # max_attempts counted across the move
        late = {e["source"]: e["attempt"] for e in example_log(log) if e["attempt"] > 1}
        assert set(late.values()) == {3}  # the moved tasks went on from their attempt 2, not from 1
    finally:
        a.kill()
        b.kill()


def _crash_until_dead(config: BridgeConfig, tmp_path: Path, unique: str, lose_disk_from: int | None,
                      starts: int) -> tuple[int, list[Any]]:
    """Start the bridge again each time the `crash` handler killed it (SIGKILL, as an OOM kill would) until the
    record is in the DLQ; from start `lose_disk_from` on, each start gets an empty store. Returns the starts."""
    log = tmp_path / "example.log"
    bridge = instance(config, tmp_path, "a", log)
    store_dir = tmp_path / "a"
    try:
        for n in range(1, starts + 1):
            if lose_disk_from is not None and n >= lose_disk_from:
                for leftover in store_dir.iterdir():
                    leftover.unlink()
            bridge.start()
            deadline = time.monotonic() + 60
            while bridge.alive and time.monotonic() < deadline:
                if read_dlq(kafka_servers(config), f"dlq-{unique}", settle=0.5, timeout=2):
                    return n, read_dlq(kafka_servers(config), f"dlq-{unique}", expect=1)
                time.sleep(0.5)
            assert not bridge.alive, f"start {n}: neither crashed nor dead-lettered in 60 s:\n{bridge.tail()}"
            assert bridge.proc.returncode == -signal.SIGKILL, bridge.tail()
        return starts + 1, read_dlq(kafka_servers(config), f"dlq-{unique}", settle=0.5, timeout=2)
    finally:
        bridge.kill()


def kafka_servers(config: BridgeConfig) -> str:
    return config.kafka.bootstrap_servers


@pytest.mark.slow
@pytest.mark.parametrize("disk", ["kept", "lost"])
def test_a_poison_pill_that_kills_the_process_reaches_the_dlq_within_max_attempts(kafka: Any, tmp_path: Path,
                                                                                  disk: str) -> None:
    """The `crash` handler SIGKILLs its bridge on every attempt; max_attempts 3. Each restart must count the
    attempt that killed the last process (seed 004: LEASE_EXPIRED counts against max_attempts). It once never
    reached the DLQ: the claim was in SQLite, not yet in the changelog, and the restore let the changelog's older
    PENDING win. On one disk: the first delivery (in-flight journal), then two claims: DEAD at the 4th start. With
    the disk lost at every start once a lapse is logged, a claim after a lost lease is logged before the handler
    runs, so each start still counts one."""
    unique = uuid.uuid4().hex[:10]
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "crash", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}", "max_attempts": 3,
              "lease": "2s", "backoff": {"kind": "fixed", "base": "100ms"}, "breaker": {"enabled": False}}},
        kafka={"topic_partitions": 1})
    ensure_topics(config)
    produce(config, f"in-{unique}", [(b"pill", b"{}", [])])
    starts, dead = _crash_until_dead(config, tmp_path, unique, 3 if disk == "lost" else None, starts=8)
    assert len(dead) == 1 and dead[0].key == b"pill", dead
    outcomes = [a["outcome"] for a in dead[0].value["attempts"]]
    assert outcomes == ["LEASE_EXPIRED"] * 3, outcomes
    assert starts <= 4, starts


@pytest.mark.slow
def test_rolling_restart_onto_fresh_volumes_loses_nothing(kafka: Any, tmp_path: Path) -> None:
    """3 bridges restarted one after the other, each onto a new empty store directory, while records flow (a
    third fail once or twice, 5% always): every record ends as a success or one DLQ record; no DLQ duplicate."""
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, backoff={"kind": "fixed", "base": "1s"}, max_attempts=3)
    ensure_topics(config)
    log = tmp_path / "example.log"
    bridges = [instance(config, tmp_path, f"b{i}", log).start() for i in range(3)]
    n, rng = 1500, random.Random(3)
    fails = [99 if rng.random() < 0.05 else rng.choice([0, 0, 0, 0, 1, 2]) for _ in range(n)]
    records = [(f"k{i}".encode(), json.dumps({"fail": f}).encode(), []) for i, f in enumerate(fails)]
    try:
        for chunk, restart in zip(range(0, n, n // 3), range(3), strict=True):
            produce(config, f"in-{unique}", records[chunk: chunk + n // 3])
            time.sleep(3)
            assert bridges[restart].terminate(60) == 0, bridges[restart].tail()
            assert not (tmp_path / f"b{restart}-fresh").exists()  # a new, empty store directory
            bridges[restart] = instance(config, tmp_path, f"b{restart}-fresh", log).start()
        dead = sum(f == 99 for f in fails)
        wait_until_sync(lambda: not account(config, log, f"in-{unique}", f"dlq-{unique}", n, dead).missing, 120,
                        "every record done")
        result = account(config, log, f"in-{unique}", f"dlq-{unique}", n, dead)
        assert not result.missing and result.duplicate_dead == 0, result.summary()
        assert len(set(result.dead)) == dead, result.summary()
    finally:
        for b in bridges:
            b.kill()


@pytest.mark.slow
def test_a_zombie_writes_nothing_after_its_partitions_moved(kafka: Any, tmp_path: Path) -> None:
    """SIGSTOP a bridge mid-attempt until the group moves its partitions, then SIGCONT it: its late writes are
    refused (its transactions are fenced by the group generation) and the new owner's state stands."""
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=1, lease="20s",
                        backoff={"kind": "fixed", "base": "200ms"}, max_attempts=6)
    ensure_topics(config)
    log = tmp_path / "example.log"
    zombie = instance(config, tmp_path, "zombie", log).start()
    heir = None
    try:
        # Attempt 1 fails; attempt 2 runs 8 s (within its 20 s lease) and then succeeds.
        produce(config, f"in-{unique}", [(b"k", json.dumps({"fail": 1, "ms": 8000}).encode(), [])])
        db = tmp_path / "zombie" / "rdq.db"
        wait_until_sync(lambda: store_rows(db, "SELECT COUNT(*) FROM tasks WHERE status = 'IN_FLIGHT'")
                        and store_rows(db, "SELECT COUNT(*) FROM tasks WHERE status = 'IN_FLIGHT'")[0][0] == 1,
                        60, "attempt 2 running on the zombie")
        time.sleep(1.0)  # the claim reaches the changelog
        os.kill(zombie.proc.pid, signal.SIGSTOP)
        heir = instance(config, tmp_path, "heir", log).start()
        # The heir restores the task IN_FLIGHT, reclaims the lapsed lease (LEASE_EXPIRED, counted), runs it.
        wait_until_sync(lambda: any(e["attempt"] >= 3 for e in example_log(log)), 90, "the heir's success")
        os.kill(zombie.proc.pid, signal.SIGCONT)
        wait_until_sync(lambda: any(e["attempt"] == 2 for e in example_log(log)), 30, "the zombie's late success")
        time.sleep(3.0)  # its writer's next rounds
        [state] = changelog_states(config, f"in-{unique}").values()
        assert state["schema"] == SCHEMA and state["task"]["status"] == "SUCCEEDED"
        workers = [(x["worker"], x["outcome"]) for x in state["attempts"]]
        assert workers[-1] == ("heir", "SUCCESS") and ("zombie", "SUCCESS") not in workers, workers
        assert [o for _, o in workers].count("LEASE_EXPIRED") == 1, workers  # the zombie's attempt, counted
        assert sum(o == "SUCCESS" for _, o in workers) == 1
        assert "stale" in zombie.tail(200) or "lost" in zombie.tail(200), zombie.tail(60)
    finally:
        with_cont(zombie)
        zombie.kill()
        if heir is not None:
            heir.kill()


def with_cont(process: BridgeProcess) -> None:
    if process.alive:
        os.kill(process.proc.pid, signal.SIGCONT)


def wait_until_sync(predicate: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


async def test_an_unreadable_changelog_record_is_kept_counted_and_skipped(kafka: Any, tmp_path: Path) -> None:
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=1)
    ensure_topics(config)
    changelog = config.changelog_topic(f"in-{unique}")
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    newer = json.dumps({"schema": "rdq.task/v9", "version": 1, "task": {}}).encode()
    for key, value in ((b"T-corrupt", b"\x00 not json"), (b"T-newer", newer)):
        producer.produce(changelog, key=key, value=value, partition=0)
    producer.flush(10)
    async with running_bridge(config) as bridge:
        await wait_until(lambda: bridge.consumer.owns(f"in-{unique}", 0), within=60, what="restored")
        rows = await bridge.store.db.read(lambda c: c.execute(
            "SELECT offset, key, error FROM changelog_unreadable ORDER BY offset").fetchall())
        assert [(r[0], r[1]) for r in rows] == [(0, b"T-corrupt"), (1, b"T-newer")]
        assert "rdq.task/v9" in rows[1][2]
        status = await bridge.consumer.changelog_status()
        assert status["unreadable"] == {f"{changelog}/0": 2}
        assert status["quarantined"] == {f"{changelog}/0": 2}  # the tasks of those keys, if any: held, not run
        assert status["partitions"][f"in-{unique}/0"]["restoring"] is False
        gauge = bridge.telemetry.metrics.changelog_unreadable.labels(f"{changelog}/0")
        await wait_until(lambda: gauge._value.get() == 2, within=10, what="metric")
        held = bridge.telemetry.metrics.changelog_quarantined.labels(f"{changelog}/0")
        assert held._value.get() == 2
        # The bridge runs on: a record is handled (and its failure restored later) as usual.
        produce(config, f"in-{unique}", [(b"k", b'{"fail": 0}', [])])
        await wait_until(lambda: bridge.consumer.stats["records"] == 1, within=30, what="consumed")


def test_a_changelog_with_the_wrong_shape_refuses_the_start(kafka: Any, tmp_path: Path) -> None:
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=3)
    ensure_topics(config.model_copy(update={"store": config.store.model_copy(update={"changelog": False})}))
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    name = config.changelog_topic(f"in-{unique}")
    admin.create_topics([NewTopic(name, 2, 1, config={"cleanup.policy": "compact"})])[name].result(30)
    wrong_count = re.escape(f"{name} has 2 partitions but its source in-{unique} has 3")
    with pytest.raises(ChangelogTopicError, match=wrong_count):
        ensure_changelogs(config, admin)
    other = kafka_config(kafka.bootstrap_servers, tmp_path, unique + "x", {
        "q": {"handler": "ok", "sources": [f"in-{unique}"]}})
    name = other.changelog_topic(f"in-{unique}")
    admin.create_topics([NewTopic(name, 3, 1, config={"cleanup.policy": "delete"})])[name].result(30)
    with pytest.raises(ChangelogTopicError, match=r"cleanup\.policy=delete"):
        ensure_changelogs(other, admin)
    # And the process says so and exits non-zero.
    process = BridgeProcess(other, tmp_path / "other.yaml").start()
    assert process.proc.wait(60) != 0
    assert "cleanup.policy=delete" in process.tail()


async def test_a_stale_group_generation_cannot_commit_a_changelog_transaction(kafka: Any, tmp_path: Path) -> None:
    """The fencing itself (KIP-447), deterministically: a writer holding the group metadata of a member whose
    partitions moved to another member cannot commit; its changelog record never becomes visible."""
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=1)
    ensure_topics(config)
    topic, changelog = f"in-{unique}", config.changelog_topic(f"in-{unique}")

    def member() -> Consumer:
        consumer = make_consumer(config)
        consumer.subscribe([topic])
        wait_until_sync(lambda: consumer.poll(0.2) is None and bool(consumer.assignment()), 60, "assignment")
        return consumer

    zombie = member()
    stale = zombie.consumer_group_metadata()
    zombie.close()  # its partition goes to the next member
    heir = member()
    store = await Store.open(tmp_path / "zombie.db", scoped=True)
    try:
        local = LocalIndex(store)
        await local.set_changelogged([topic])
        await local.set_home((topic, 0), HomeState.ACTIVE)
        task = failure()
        task = type(task)(**{**task.__dict__, "headers": {**task.headers, "rdq.source": f"kafka://{topic}/0/0"}})
        await store.submit(task)
        writer = ChangelogWriter(local, {topic: changelog},
                                 lambda: make_changelog_producer(config, 1_000_000),
                                 lambda: {(topic, 0): 0}, lambda: stale, _Clock())
        stop = asyncio.Event()
        running = asyncio.create_task(writer.run(stop))
        try:
            await wait_until(lambda: writer.stats["fenced"] + writer.stats["transactions"] >= 1, within=60,
                             what="a transaction tried")
        finally:
            stop.set()
            await running
            await writer.close()
        assert writer.stats["fenced"] >= 1 and writer.stats["transactions"] == 0, writer.stats
        assert [e.task_id for e in await local.outbox(10)] == [task.id]  # still unlogged here
        assert changelog_states(config, topic) == {}  # and nothing of it in the changelog
    finally:
        heir.close()
        await store.close()


class _SlowMarks(LocalIndex):
    """The real index; once `slow`, its "logged" marks reach the store only when `gate` is set (a store writer
    behind)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.slow = False
        self.gate = asyncio.Event()
        self._later: list[asyncio.Task[None]] = []

    def mark_logged_soon(self, entries: Any) -> asyncio.Future[None]:
        if not self.slow:
            return super().mark_logged_soon(entries)
        entries, marked = list(entries), asyncio.get_running_loop().create_future()

        async def later() -> None:
            await self.gate.wait()
            await LocalIndex.mark_logged_soon(self, entries)
            marked.set_result(None)

        self._later.append(asyncio.create_task(later()))
        return marked


async def test_a_flush_ends_the_waits_its_marks_settle_and_commits_past_them(kafka: Any, tmp_path: Path) -> None:
    """A failure's task is logged by a round before its record's wait for it is added, and its mark is still
    queued when the next round asks the store: that wait is left for a later round. A flush (a hand-over) that
    did not end it once the marks settled said "committed" with the record not done: the commit stayed below it,
    and the next owner ran every record after it again (the scale-down run on CI: 53 duplicate successes)."""
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=1)
    ensure_topics(config)
    topic, changelog = f"in-{unique}", config.changelog_topic(f"in-{unique}")
    member = make_consumer(config)
    member.subscribe([topic])
    wait_until_sync(lambda: member.poll(0.2) is None and bool(member.assignment()), 60, "assignment")
    store = await Store.open(tmp_path / "rdq.db", scoped=True)
    local = _SlowMarks(store)
    positions = {(topic, 0): 0}
    writer = ChangelogWriter(local, {topic: changelog}, lambda: make_changelog_producer(config, 1_000_000),
                             lambda: dict(positions), member.consumer_group_metadata, _Clock(), interval=3600)
    stop = asyncio.Event()
    running = asyncio.create_task(writer.run(stop))
    try:
        await local.set_changelogged([topic])
        await local.set_home((topic, 0), HomeState.ACTIVE)
        task = failure()
        task = type(task)(**{**task.__dict__, "headers": {**task.headers, "rdq.source": f"kafka://{topic}/0/0"}})
        await wait_until(lambda: writer._producer is not None, within=60, what="the changelog producer")
        written = time.monotonic()
        await store.submit(task)
        local.slow = True
        assert await writer._one_round()  # logs the task; its mark waits behind the gate
        writer.when_logged(task.id, lambda: positions.update({(topic, 0): 1}), written)  # the record is done
        asyncio.get_running_loop().call_later(0.3, local.gate.set)
        assert await writer.flush()
        assert positions == {(topic, 0): 1}  # the wait ended within the flush...
        committed = member.committed([TopicPartition(topic, 0)], timeout=10)
        assert committed[0].offset == 1  # ...and the offset past the record committed by it
    finally:
        local.gate.set()
        stop.set()
        writer._kick.set()  # its rounds wait for a kick (no interval here)
        await running
        await writer.close()
        member.close()
        await store.close()


async def test_a_dlq_record_whose_task_left_with_its_partition_is_not_published(kafka: Any, tmp_path: Path) -> None:
    """After a loss (no assignment: no group metadata, no offsets) a DLQ record still queued for a task this
    instance dropped went out in a transaction with nothing to fence it — the new owner restored the task and
    published it too: a DLQ duplicate (found reading the code after a long nemesis soak counted 6)."""
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=1)
    ensure_topics(config)
    topic, changelog, dlq = f"in-{unique}", config.changelog_topic(f"in-{unique}"), f"dlq-{unique}"
    store = await Store.open(tmp_path / "lost.db", scoped=True)
    try:
        local = LocalIndex(store)
        await local.set_changelogged([topic])
        writer = ChangelogWriter(local, {topic: changelog}, lambda: make_changelog_producer(config, 1_000_000),
                                 lambda: {}, lambda: None, _Clock())
        outcomes: list[Any] = []
        stop = asyncio.Event()
        running = asyncio.create_task(writer.run(stop))
        try:
            writer.produce_dlq("T-dropped", (topic, 0), dlq, b"k", b"{}", [], lambda err, msg: outcomes.append(err))
            await wait_until(lambda: bool(outcomes), within=60, what="the DLQ record's outcome")
        finally:
            stop.set()
            await running
            await writer.close()
        assert outcomes[0] is not None  # refused, not published
        assert read_dlq(kafka.bootstrap_servers, dlq, settle=2.0) == []
    finally:
        await store.close()


class _Clock:
    def now_ms(self) -> int:
        return int(time.time() * 1000)


@pytest.mark.slow
async def test_a_restore_waits_for_the_broker_and_the_partition_stays_unready(stoppable_broker: Any,
                                                                               tmp_path: Path) -> None:
    """The broker goes away as an assignment's partitions start restoring (all at once, one consumer): every
    partition stays unready, nothing of them is consumed or run, and each restore completes when the broker is
    back (the partitions assigned again); none is marked ready early."""
    broker = stoppable_broker
    unique = uuid.uuid4().hex[:10]
    config = kafka_config(broker.bootstrap_servers, tmp_path / "one", unique, {
        "q": {"handler": "flaky", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}",
              "backoff": {"kind": "fixed", "base": "1h"}}}, kafka={"topic_partitions": 3}, telemetry={"port": 0})
    ensure_topics(config)
    produce(config, f"in-{unique}", [(f"k{i}".encode(), b'{"fail": 5}', []) for i in range(20)])
    async with running_bridge(config) as first:
        await wait_until(lambda: first.telemetry.metrics.tasks_created.labels("q", "PENDING")._value.get() == 20,
                         within=60, what="20 tasks")
    # The first bridge handed its tasks over (its file is empty); a second one on a fresh store restores them.
    config = config.model_copy(update={"store": config.store.model_copy(update={"path": tmp_path / "two.db"})})
    partitions = [(f"in-{unique}", p) for p in range(3)]
    async with running_bridge(config, instance_id="second") as second:
        assert second.changelog is not None and second.health is not None
        restore_many = second.changelog.restorer.restore_many
        calls = 0

        async def broker_goes_away(homes: Any, wanted: Any, restored: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                await asyncio.to_thread(broker.stop)
            return await restore_many(homes, wanted, restored)

        second.changelog.restorer.restore_many = broker_goes_away  # type: ignore[method-assign]
        await wait_until(lambda: calls >= 1, within=60, what="the restore begun")
        for _ in range(20):  # the outage: the partition is never ready, nothing of it runs or is consumed
            assert not any(second.consumer.owns(*tp) for tp in partitions) and not second.health.ready
            assert second.consumer.stats["records"] == 0 and await second.store.counts() == {}
            await asyncio.sleep(0.5)
        await asyncio.to_thread(broker.start)
        await wait_until(lambda: all(second.consumer.owns(*tp) for tp in partitions), within=120,
                         what="every partition restored once the broker is back")
        counts = await second.store.counts()
        assert counts["q"]["PENDING"] == 20
        await wait_until(lambda: second.health is not None and second.health.ready, within=60, what="ready")


async def test_an_assignments_partitions_restore_at_once_and_an_open_transaction_holds_only_its_own(
        kafka: Any, tmp_path: Path) -> None:
    """A restart's partitions restore together, each ready when its own changelog is read: one whose changelog
    ends in another producer's open transaction waits for it alone; the others run meanwhile (before, they
    restored one after another, each behind the one before)."""
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=3, backoff={"kind": "fixed", "base": "1h"})
    ensure_topics(config)
    topic = f"in-{unique}"
    source = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for i in range(9):
        source.produce(topic, key=f"k{i}".encode(), value=b'{"fail": 5}', partition=i % 3)
    assert source.flush(30) == 0
    async with running_bridge(config) as first:
        await wait_until(lambda: first.telemetry.metrics.tasks_created.labels("q", "PENDING")._value.get() == 9,
                         within=60, what="9 tasks")
    # Another producer's transaction open on changelog partition 0 (sorted first: it would have held the rest).
    holder = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": f"holder-{unique}",
                       "transaction.timeout.ms": 60_000})
    holder.init_transactions(30)
    holder.begin_transaction()
    holder.produce(config.changelog_topic(topic), key=b"T-open", value=None, partition=0)
    assert holder.flush(30) == 0
    config = config.model_copy(update={"store": config.store.model_copy(update={"path": tmp_path / "two.db"})})
    try:
        async with running_bridge(config, instance_id="second") as second:
            await wait_until(lambda: second.consumer.owns(topic, 1) and second.consumer.owns(topic, 2), within=60,
                             what="partitions 1 and 2 restored while 0 waits")
            assert not second.consumer.owns(topic, 0)
            ready = await second.store.db.read(lambda c: c.execute(
                "SELECT COUNT(*) FROM tasks WHERE home_partition IN (1, 2) AND status = 'PENDING'").fetchone()[0])
            assert ready == 6
            holder.abort_transaction(30)  # the open transaction ends: partition 0's changelog is read to its end
            await wait_until(lambda: second.consumer.owns(topic, 0), within=60, what="partition 0 restored")
            counts = await second.store.counts()
            assert counts["q"]["PENDING"] == 9
    finally:
        with contextlib.suppress(Exception):
            holder.abort_transaction(5)


async def test_a_partition_lost_and_assigned_again_at_once_is_restored_and_runs(kafka: Any, tmp_path: Path) -> None:
    """A static member back within its session: librdkafka reports its partitions lost and assigns them again
    ~100 ms later, while the lost ones' clean-up (hand-over, dropping the file's copy) is still running. The new
    assignment restores after that clean-up and runs; before, the late clean-up wiped the new assignment's state:
    the partition stayed unowned, its tasks dropped from this file, its records not run (seen in the nemesis)."""
    from confluent_kafka import TopicPartition

    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=1, backoff={"kind": "fixed", "base": "1h"})
    ensure_topics(config)
    topic = f"in-{unique}"
    produce(config, topic, [(f"k{i}".encode(), b'{"fail": 5}', []) for i in range(5)])
    async with running_bridge(config) as bridge:
        assert bridge.changelog is not None
        await wait_until(lambda: bridge.consumer.owns(topic, 0) and committed_lag(config, topic) == 0, within=60,
                         what="5 tasks in the changelog, their offsets committed")
        hand_over = bridge.changelog.hand_over

        async def slow_hand_over(tps: Any, grace: float) -> Any:  # the clean-up outlives the next assignment
            await asyncio.sleep(1.0)
            return await hand_over(tps, grace)

        bridge.consumer.changelog.hand_over = slow_hand_over  # type: ignore[union-attr]
        consumer = bridge.consumer.kafka
        partitions = [TopicPartition(topic, 0)]

        def lost_then_assigned() -> None:  # on the consumer thread, as librdkafka calls them inside consume
            bridge.consumer.ownership.on_lost(consumer, partitions)
            bridge.consumer.ownership.on_assign(consumer, partitions)

        await bridge.consumer.thread.call(lost_then_assigned)
        await asyncio.sleep(1.5)  # past the slow clean-up
        await wait_until(lambda: bridge.consumer.owns(topic, 0), within=30, what="the partition owned again")
        assert (await bridge.store.counts())["q"]["PENDING"] == 5  # restored after the clean-up, not wiped by it
        produce(config, topic, [(b"later", b'{"fail": 0}', [])])
        await wait_until(lambda: bridge.consumer.stats["records"] == 6, within=30, what="a new record consumed")
        await wait_until(lambda: committed_lag(config, topic) == 0, within=30, what="the new record done, committed")
        counts = {status: n for status, n in (await bridge.store.counts())["q"].items() if n}
        assert counts == {"PENDING": 5}  # it succeeded: no task of its own


@pytest.mark.parametrize("decoding", ["on the restore thread", "in a process"])
async def test_a_restore_over_many_batches_applies_every_batch_before_its_partition_is_ready(
        kafka: Any, tmp_path: Path, decoding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore fetches the next batch while the store applies this one: a partition is finished only by the
    reach of batches already applied. Its changelog's last records (a newer state of one task, a tombstone of
    another) come in the last of three batches; a partition with a few records restores beside it. Decoded on the
    restore thread, or in the decoding process (made to wait for it: it would decode here until it is up)."""
    from bench.bench_changelog import task_record
    from bridge.changelog.restore import Restorer
    from bridge.clock import SystemClock
    from bridge.kafka_clients import make_restore_consumer

    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=2)
    ensure_topics(config)
    topic = f"in-{unique}"
    changelog = config.changelog_topic(topic)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 20})
    n = 11_998
    def put(record: tuple[bytes, bytes | None], partition: int) -> None:
        producer.produce(changelog, key=record[0], value=record[1], partition=partition)

    for i in range(n):
        put(task_record(i, topic, 1), 0)
        if i % 2000 == 0:
            producer.poll(0)
    put(task_record(7, topic, 3), 0)  # a later state of task 7: three attempts
    put((task_record(5, topic, 1)[0], None), 0)  # task 5 ends: a tombstone
    for i in range(10):
        put(task_record(n + i, topic, 2, partition=1), 1)
    assert producer.flush(60) == 0
    store = await Store.open(tmp_path / "restored.db", scoped=True)
    try:
        local = LocalIndex(store)
        await local.set_changelogged([topic])
        in_process = decoding == "in a process"
        if in_process:
            from bridge.changelog.side import SideProcess
            monkeypatch.setattr(SideProcess, "ready",  # waits for the process: every batch decoded in it
                                property(lambda self: self._started is not None and self._started.result(60) > 0))
        restorer = Restorer(local, {topic: changelog}, lambda: make_restore_consumer(config, "t"), SystemClock(),
                            lambda: make_restore_consumer(config, "t", committed_only=False),
                            process_from=0 if in_process else 10**9)
        trims: list[bool] = []
        monkeypatch.setattr("bridge.changelog.restore.give_back_freed_memory", lambda: trims.append(True))
        reports: dict[int, Any] = {}

        async def restored(report: Any) -> None:
            reports[report.home[1]] = report

        failed = await restorer.restore_many([(topic, 0), (topic, 1)], lambda _: True, restored)
        assert not failed
        assert reports[0].records == n + 2 and reports[0].tasks == n + 1 and reports[0].tombstones == 1
        counts = await store.db.read(lambda c: c.execute(
            "SELECT home_partition, COUNT(*) FROM tasks GROUP BY home_partition ORDER BY 1").fetchall())
        counts = [tuple(row) for row in counts]
        assert counts == [(0, n - 1), (1, 10)]
        seven = await store.get(task_record(7, topic, 1)[0].decode())
        assert seven is not None and seven.attempt_count == 3 and len(seven.attempts) == 3
        assert await store.get(task_record(5, topic, 1)[0].decode()) is None
        assert (restorer.decoded_in_process >= 3) == in_process, restorer.decoded_in_process
        assert trims == [True]  # the batches' memory given back to the system once the restore ended
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def restorer_of(config: BridgeConfig, tmp_path: Path, topic: str, partitions: int) -> AsyncIterator[Any]:
    """A fresh store with `topic` changelogged, its Restorer, and a restore consumer assigned to the changelog's
    first `partitions` partitions (for tests that drive the restore's steps themselves)."""
    from bridge.changelog.restore import Restorer
    from bridge.clock import SystemClock
    from bridge.kafka_clients import make_restore_consumer

    changelog = config.changelog_topic(topic)
    store = await Store.open(tmp_path / "restored.db", scoped=True)
    consumer = make_restore_consumer(config, "t")
    try:
        local = LocalIndex(store)
        await local.set_changelogged([topic])
        restorer = Restorer(local, {topic: changelog}, lambda: make_restore_consumer(config, "t"), SystemClock())
        consumer.assign([TopicPartition(changelog, p, 0) for p in range(partitions)])
        yield store, local, restorer, consumer
    finally:
        consumer.close()
        await store.close()


async def test_batches_read_ahead_are_applied_in_the_order_read_whichever_decoded_first(
        kafka: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore reads and decodes the next batches while the store applies one. Here each batch takes less time
    to come than the one read before it, so they finish out of order: task 3's three states, one a batch, must
    still end at its last, task 5's tombstone (last batch) must win over its record (first batch), and no batch
    may be left behind when the partition's end is reached."""
    from bench.bench_changelog import task_record
    from bridge.changelog.decoder import Decoder
    from bridge.changelog.fetched import Fetched
    from bridge.changelog.picking import pick_last
    from bridge.changelog.restore import Restorer, _Restoring

    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=1)
    ensure_topics(config)
    topic = f"in-{unique}"
    changelog = config.changelog_topic(topic)
    batches: list[list[tuple[int, bytes | None, bytes | None]]] = [[], [], [], []]
    offset = 0
    for batch, (first, attempts) in enumerate([(0, 1), (10, 2), (20, 3)]):
        records = [task_record(i, topic, 1) for i in range(first, first + 10)] + [task_record(3, topic, attempts)]
        if batch == 2:
            records.append((task_record(5, topic, 1)[0], None))
        for key, value in records:
            batches[batch].append((offset, key, value))
            offset += 1
    end = offset
    reads = iter(range(len(batches)))

    async def read_decoded(self: Restorer, consumer: Any, decoder: Any, keys: Any) -> Fetched:
        n = next(reads, len(batches) - 1)
        await asyncio.sleep(0.05 * (len(batches) - n))  # each read ahead comes back before the one before it
        fetched = Fetched()
        if batches[n]:
            fetched.batches[(changelog, 0)] = (pick_last(batches[n]), len(batches[n]))
            fetched.reach((changelog, 0), batches[n][-1][0] + 1)
        return fetched

    monkeypatch.setattr(Restorer, "_read_decoded", read_decoded)
    async with restorer_of(config, tmp_path, topic, 1) as (store, local, restorer, consumer):
        part = _Restoring((topic, 0), changelog, end=end, empty=False)
        await local.restore_begin(part.home)
        reports: list[Any] = []

        async def restored(report: Any) -> None:
            reports.append(report)

        failed: dict[Any, Exception] = {}
        decoder = Decoder(lambda records: asyncio.sleep(0, pick_last(records)))
        await restorer._read_all(consumer, decoder, {part.partition: part}, lambda _: True, restored, failed)
        assert not failed and len(reports) == 1 and reports[0].records == end
        three = await store.get(task_record(3, topic, 1)[0].decode())
        assert three is not None and three.attempt_count == 3
        assert await store.get(task_record(5, topic, 1)[0].decode()) is None
        count = await store.db.read(lambda c: c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])
        assert count == 29  # tasks 0-29 but the tombstoned one


async def test_a_fetchs_batches_of_several_partitions_are_applied_in_one_commit_and_fail_apart(
        kafka: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One fetch of a many-partition restore brings a batch of each: they are applied in one group commit (one
    fsync, not one a partition). A batch the store refuses fails its own partition (given up, retried by the
    owner) and not the others of the commit."""
    from bench.bench_changelog import task_record
    from bridge.changelog.fetched import Fetched
    from bridge.changelog.picking import pick_last
    from bridge.changelog.restore import RestoreFailed, _Restoring
    from bridge.store.database import StoreError

    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=3)
    ensure_topics(config)
    topic = f"in-{unique}"
    changelog = config.changelog_topic(topic)
    async with restorer_of(config, tmp_path, topic, 3) as (store, local, restorer, consumer):
        reading = {}
        fetched = Fetched()
        for p in range(3):
            part = reading[(changelog, p)] = _Restoring((topic, p), changelog, end=10, empty=False)
            await local.restore_begin(part.home)
            records = [(i, *task_record(100 * p + i, topic, 2, partition=p)) for i in range(10)]
            fetched.batches[(changelog, p)] = (pick_last(records), len(records))
        applying = LocalIndex.restore_batch

        async def refuse_partition_1(self: LocalIndex, home: Any, *args: Any) -> Any:
            if home[1] == 1:
                raise StoreError("refused")
            return await applying(self, home, *args)

        monkeypatch.setattr(LocalIndex, "restore_batch", refuse_partition_1)
        commits = store.db.stats.batches
        failed: dict[Any, Exception] = {}
        await restorer._apply(fetched, reading, consumer, failed)
        assert store.db.stats.batches == commits + 1
        assert list(failed) == [(topic, 1)] and isinstance(failed[(topic, 1)], RestoreFailed)
        assert sorted(p for _, p in reading) == [0, 2]  # partition 1 left the restore; the others go on
        assert [reading[(changelog, p)].tasks for p in (0, 2)] == [10, 10]
        rows = await store.db.read(lambda c: c.execute(
            "SELECT home_partition, COUNT(*) FROM tasks GROUP BY 1 ORDER BY 1").fetchall())
        assert [tuple(row) for row in rows] == [(0, 10), (2, 10)]


async def test_a_partition_not_fetched_for_a_while_is_not_taken_for_finished(kafka: Any, tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A restore of many partitions through one consumer can leave one unfetched for a while (seen: 12 partitions
    of a 1M-task restore, ten of them not fetched for over 10 s). That stall once passed for "only commit markers
    are left", and the partition was finished with its unread tasks dropped as purged. Here its changelog holds
    five records of one committed transaction (the marker after them): read to offset 2 and stalled, it has
    records to read and says so; read to 5, only the marker is left and it is finished."""
    import logging

    from bench.bench_changelog import task_record
    from bridge.changelog.restore import Restorer, _Restoring
    from bridge.clock import SystemClock
    from bridge.kafka_clients import make_restore_consumer

    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=1)
    ensure_topics(config)
    topic = f"in-{unique}"
    changelog = config.changelog_topic(topic)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": f"t-{unique}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(5):
        producer.produce(changelog, key=task_record(i, topic, 1)[0], value=task_record(i, topic, 1)[1], partition=0)
    producer.commit_transaction(30)
    store = await Store.open(tmp_path / "restored.db", scoped=True)
    consumer = make_restore_consumer(config, "t")
    try:
        restorer = Restorer(LocalIndex(store), {topic: changelog}, lambda: make_restore_consumer(config, "t"),
                            SystemClock(), probe_factory=lambda: make_restore_consumer(config, "t", probe=True))
        _, end = consumer.get_watermark_offsets(TopicPartition(changelog, 0), 10.0, False)
        assert end == 6  # five records and the commit marker
        stalled = _Restoring((topic, 0), changelog, end=end, reached=2, last_progress=time.monotonic() - 60)
        with caplog.at_level(logging.WARNING, "bridge.changelog.restore"):
            assert not await restorer._stalled_at_markers(consumer, stalled)
        assert "at offset 2 of 6, its records not fetched" in caplog.text
        never_fetched = _Restoring((topic, 0), changelog, end=end, last_progress=time.monotonic() - 60)
        assert not await restorer._stalled_at_markers(consumer, never_fetched)
        at_its_last = _Restoring((topic, 0), changelog, end=end, reached=5, last_progress=time.monotonic() - 60)
        assert await restorer._stalled_at_markers(consumer, at_its_last)
    finally:
        consumer.close()
        await store.close()


def _put_tasks(kafka: Any, topic: str, changelog: str, each: int) -> None:
    """`each` tasks' changelog records in partitions 0 and 1 (task ids 0.. and 10..)."""
    from bench.bench_changelog import task_record

    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for partition in (0, 1):
        for i in range(each):
            key, value = task_record(partition * 10 + i, topic, 1, partition=partition)
            producer.produce(changelog, key=key, value=value, partition=partition)
    assert producer.flush(30) == 0


class _AssignSpy:
    """A restore consumer that notes what it was assigned (a confluent-kafka Consumer takes no attributes)."""

    def __init__(self, consumer: Consumer, assigned: list[tuple[int, int]]) -> None:
        self._consumer, self._assigned = consumer, assigned

    def assign(self, partitions: list[TopicPartition]) -> None:
        self._assigned.extend((tp.partition, tp.offset) for tp in partitions)
        self._consumer.assign(partitions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


class _DeletesOnClose:
    """The restore's end probe: once it has read the ends, the log start of partition 1 moves on (retention)."""

    def __init__(self, probe: Consumer, delete: Any) -> None:
        self._probe, self._delete = probe, delete

    def close(self) -> None:
        self._probe.close()
        self._delete()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._probe, name)


async def test_a_restore_reads_from_each_log_start_and_from_a_new_one_when_it_moved_since(
        kafka: Any, tmp_path: Path) -> None:
    """Each changelog partition is assigned at its log start as the end probe found it (a known offset: a logical
    OFFSET_BEGINNING is resolved by librdkafka ~0.5 s later); partition 0's start is past records deleted before
    the restore. Partition 1's start moves on between the probe and the assignment: the fetch is out of range,
    `auto.offset.reset` takes it from its new start, and its restore still ends with what is left."""
    from bench.bench_changelog import task_record
    from bridge.changelog.restore import Restorer
    from bridge.clock import SystemClock
    from bridge.kafka_clients import make_restore_consumer

    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=2)
    topic = f"in-{unique}"
    # Not compacted (the broker refuses to delete a compacted topic's records): the restore reads it all the same.
    changelog = f"log-{unique}"
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    admin.create_topics([NewTopic(changelog, 2, 1)])[changelog].result(30)
    _put_tasks(kafka, topic, changelog, 5)

    def delete_before(partition: int, offset: int) -> None:
        for future in admin.delete_records([TopicPartition(changelog, partition, offset)]).values():
            future.result(30)

    delete_before(0, 2)
    assigned: list[tuple[int, int]] = []
    store = await Store.open(tmp_path / "restored.db", scoped=True)
    try:
        local = LocalIndex(store)
        await local.set_changelogged([topic])
        restorer = Restorer(
            local, {topic: changelog}, lambda: _AssignSpy(make_restore_consumer(config, "t"), assigned),
            SystemClock(), lambda: _DeletesOnClose(make_restore_consumer(config, "t", committed_only=False),
                                                  lambda: delete_before(1, 3)))
        reports: dict[int, Any] = {}

        async def restored(report: Any) -> None:
            reports[report.home[1]] = report

        failed = await asyncio.wait_for(restorer.restore_many([(topic, 0), (topic, 1)], lambda _: True, restored), 60)
        assert not failed
        assert sorted(assigned) == [(0, 2), (1, 0)]  # known offsets, not OFFSET_BEGINNING (-2)
        ids = await store.db.read(lambda c: [row[0] for row in c.execute("SELECT id FROM tasks ORDER BY id")])
        expected = sorted(task_record(i, topic, 1)[0].decode() for i in (2, 3, 4, 13, 14))
        assert ids == expected
        assert (reports[0].tasks, reports[1].tasks) == (3, 2)
    finally:
        await store.close()


async def test_a_fetch_does_not_wait_out_its_poll_once_every_partition_is_at_its_end(
        kafka: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch waits up to _POLL for a full batch, but not once every partition it reads is at its end: nothing
    more is coming. Here _POLL is two minutes: a restore of two small partitions that waited it out in each fetch
    (its first, and the read-ahead behind it) would take minutes, not seconds."""

    monkeypatch.setattr("bridge.changelog.restore._POLL", 120.0)
    unique = uuid.uuid4().hex[:10]
    config = config_for(kafka, tmp_path, unique, partitions=2)
    ensure_topics(config)
    topic = f"in-{unique}"
    changelog = config.changelog_topic(topic)
    _put_tasks(kafka, topic, changelog, 3)
    async with restorer_of(config, tmp_path, topic, 0) as (_store, _, restorer, _):
        reports: list[Any] = []

        async def restored(report: Any) -> None:
            reports.append(report)

        failed = await asyncio.wait_for(restorer.restore_many([(topic, 0), (topic, 1)], lambda _: True, restored), 30)
        assert not failed and sorted(r.tasks for r in reports) == [3, 3]
