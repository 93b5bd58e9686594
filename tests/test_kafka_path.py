"""The bridge as a running service on a real broker (SPEC §4.1, §4.10, §5, §6)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest

from bridge.records import trace_id
from tests.conftest import KafkaEnv
from tests.kafka_helpers import (
    aread_dlq,
    await_lag,
    example_log,
    kafka_config,
    lag,
    produce,
    read_dlq,
    running_bridge,
    wait_until,
)

pytestmark = pytest.mark.kafka
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_success_leaves_no_task_and_commits(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                                  example_log_path: Path) -> None:
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "ok.q": {"handler": "ok", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}"}})
    async with running_bridge(config) as bridge:
        produce(config, f"in-{unique}", [(f"k{i}".encode(), b"{}", []) for i in range(50)])
        await wait_until(lambda: len(example_log(example_log_path)) >= 50, what="50 successes")
        assert await bridge.store.counts() == {}
        await await_lag(config, f"in-{unique}", 0)
    assert {line["attempt"] for line in example_log(example_log_path)} == {1}


async def test_flaky_succeeds_on_retry_and_publishes_nothing(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                                             example_log_path: Path) -> None:
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "flaky.q": {"handler": "flaky", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}",
                    "max_attempts": 4, "backoff": {"kind": "fixed", "base": "50ms"}}})
    async with running_bridge(config) as bridge:
        produce(config, f"in-{unique}", [(b"k", b'{"fail": 2}', [])])
        await wait_until(lambda: len(example_log(example_log_path)) >= 1, what="the retry's success")
        [task] = await bridge.store.list_tasks()
        assert task.status == "SUCCEEDED" and task.attempt_count == 3
    assert example_log(example_log_path)[0]["attempt"] == 3
    assert read_dlq(kafka.bootstrap_servers, f"dlq-{unique}", settle=1.0) == []


@pytest.mark.parametrize("case", ["exhausted", "permanent", "unroutable"])
async def test_dead_records_reach_the_dlq_once_with_their_whole_history(
        kafka: KafkaEnv, tmp_path: Path, unique: str, example_log_path: Path, case: str) -> None:
    handler, payload, attempts, error_type = {
        "exhausted": ("flaky", b'{"fail": 99}', 3, "handlers.examples.TransientError"),
        "permanent": ("permanent", b"{}", 1, "bridge.handler_api.Permanent"),
        "unroutable": ("no-such-handler", b"{}", 0, "rdq.Unroutable"),
    }[case]
    topic, dlq = f"in-{unique}", f"dlq-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": handler, "sources": [topic], "dlq_topic": dlq, "max_attempts": 3,
              "backoff": {"kind": "fixed", "base": "20ms"}}})
    key = b"\x00\xffbinary-key\x80"
    headers = [("traceparent", TRACEPARENT.encode()), ("bin", b"\xff\xfe\x00"), ("team", b"orders")]
    async with running_bridge(config) as bridge:
        produce(config, topic, [(key, payload, headers)])
        [record] = await aread_dlq(kafka.bootstrap_servers, dlq, expect=1, timeout=60)
        await wait_until(lambda: bridge.dlq.published >= 1, what="the publish recorded")
        [task] = await bridge.store.list_tasks()
        assert task.dlq_state == "PUBLISHED" and task.dlq_offset == record.offset and task.dlq_topic == dlq
    env = record.value
    assert env["schema"] == "rdq.dead-letter/v1"
    assert env["reason"]["type"] == error_type
    assert env["task"]["status"] == "DEAD" and env["task"]["attempt_count"] == attempts
    assert base64.b64decode(env["task"]["payload"]) == payload
    assert len(env["attempts"]) == attempts
    for i, attempt in enumerate(env["attempts"], start=1):
        assert attempt["attempt_no"] == i and attempt["started_at"].endswith("Z") and attempt["finished_at"]
        assert attempt["error"]["type"] == error_type and attempt["error"]["message"]
        assert attempt["error"]["stack"]
    # Headers follow the record: trace id, source offset, key, and its own headers byte for byte.
    assert record.key == key
    assert trace_id(record.headers["traceparent"].decode()) == trace_id(TRACEPARENT)
    assert record.headers["rdq.source"] == f"kafka://{topic}/{record_partition(env)}/0".encode()
    assert record.headers["rdq.task_id"].decode() == env["task"]["id"]
    assert record.headers["rdq.error.type"].decode() == error_type
    assert record.headers["rdq.attempts"] == str(attempts).encode()
    assert record.headers["bin"] == b"\xff\xfe\x00" and record.headers["team"] == b"orders"
    assert example_log(example_log_path) == []


def record_partition(env: dict) -> str:  # type: ignore[type-arg]
    return env["task"]["headers"]["rdq.source"].split("/")[3]


async def test_a_record_without_traceparent_gets_one(kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "permanent", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}"}})
    async with running_bridge(config):
        produce(config, f"in-{unique}", [(None, b"x", [])])
        [record] = await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", expect=1)
    traceparent = record.headers["traceparent"].decode()
    assert traceparent == record.value["task"]["headers"]["traceparent"]
    assert len(trace_id(traceparent)) == 32 and record.key is None


async def test_oversized_dlq_record_is_trimmed_never_dropped(kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """A DLQ topic with a 100 kB limit; a 60 kB payload; five attempts with 20 kB errors."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from bridge.handler_api import HandlerContext
    from bridge.registry import Registry

    registry = Registry()

    def huge_error(ctx: HandlerContext) -> None:
        raise ValueError(f"attempt {ctx.attempt}: " + "e" * 20_000)

    registry.register("huge", huge_error)
    dlq = f"dlq-{unique}"
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    admin.create_topics([NewTopic(dlq, 1, 1, config={"max.message.bytes": "100000"})])[dlq].result(30)
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "huge", "sources": [f"in-{unique}"], "dlq_topic": dlq, "max_attempts": 5,
              "backoff": {"kind": "fixed", "base": "10ms"}}})
    payload = bytes(range(256)) * 240  # 61,440 bytes, not UTF-8
    async with running_bridge(config, registry):
        produce(config, f"in-{unique}", [(b"big", payload, [])])
        [record] = await aread_dlq(kafka.bootstrap_servers, dlq, expect=1)
    env = record.value
    assert base64.b64decode(env["task"]["payload"]) == payload  # the payload is kept whole
    trimmed = env["trimmed"]
    assert trimmed["original_bytes"] > 100_000 and trimmed["stacks"] == "removed"
    kept = [(a["redrive_no"], a["attempt_no"]) for a in env["attempts"]]
    removed = [(r["redrive_no"], r["attempt_no"]) for r in trimmed["attempts_removed"]]
    assert kept[0] == (0, 1) and kept[-1] == (0, 5) and sorted(kept + removed) == [(0, n) for n in range(1, 6)]
    assert record.headers["rdq.attempts"] == b"5"
    assert len(json.dumps(env)) < 100_000


async def test_large_payload_reaches_the_dlq_intact(kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "permanent", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}"}})
    payload = b"\xff" * 900_000  # near the source topic's 1 MB limit; base64 in the envelope is ~1.2 MB
    async with running_bridge(config):
        produce(config, f"in-{unique}", [(b"k", payload, [])])
        [record] = await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", expect=1)
    assert base64.b64decode(record.value["task"]["payload"]) == payload
    assert "trimmed" not in record.value


async def test_a_slow_handler_does_not_cap_a_partition_at_one_record(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                                                       example_log_path: Path) -> None:
    from bridge.handler_api import HandlerContext
    from bridge.registry import Registry

    registry = Registry()
    running, peak = 0, 0

    async def slow(ctx: HandlerContext) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.5)
        running -= 1

    registry.register("slow", slow)
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "slow", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}"}},
        kafka={"topic_partitions": 1, "partition_concurrency": 8})
    async with running_bridge(config, registry):
        produce(config, f"in-{unique}", [(None, b"{}", []) for _ in range(40)])
        await await_lag(config, f"in-{unique}", 0)
    assert peak == 8  # one partition, eight records at a time; 40 records took ~2.5 s, not 20 s


async def test_the_fetched_backlog_is_bounded_in_bytes_not_only_in_records(kafka: KafkaEnv, tmp_path: Path,
                                                                             unique: str) -> None:
    """0.9 MB records behind a slow handler: the bridge holds at most its share of `kafka.max_buffered_mb` of them
    waiting (plus what one poll brings), not the 2,000 records a partition's count allows (2 GB)."""
    from bridge.handler_api import HandlerContext
    from bridge.registry import Registry

    registry = Registry()
    handled: list[int] = []

    async def slow(ctx: HandlerContext) -> None:
        await asyncio.sleep(0.1)
        handled.append(len(ctx.payload))

    registry.register("slow", slow)
    topic = f"in-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "slow", "sources": [topic], "dlq_topic": f"dlq-{unique}"}},
        kafka={"topic_partitions": 1, "partition_concurrency": 1, "max_buffered_mb": 8,
               "consumer": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000,
                            "fetch.max.bytes": 2_000_000, "max.partition.fetch.bytes": 2_000_000}})
    payload = b"x" * 900_000  # under the broker's default max.message.bytes with its batch framing
    peak = 0
    async with running_bridge(config, registry) as bridge:
        produce(config, topic, [(None, payload, []) for _ in range(60)])

        def sample() -> bool:
            nonlocal peak
            peak = max(peak, bridge.consumer.backlog_bytes())
            return len(handled) >= 60

        await wait_until(sample, within=60, interval=0.01, what="all 60 records handled")
    # Its share: half of 8 MB for one partition = 4 MB; a poll adds at most librdkafka's queue (4 MB) on top.
    assert 0 < peak <= 8_500_000, peak
    assert handled == [900_000] * 60  # nothing lost


async def test_max_open_tasks_pauses_the_source_until_the_queue_drains(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                                                        example_log_path: Path) -> None:
    topic = f"in-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "flaky", "sources": [topic], "dlq_topic": f"dlq-{unique}", "max_open_tasks": 5,
              "max_attempts": 3, "backoff": {"kind": "fixed", "base": "1500ms"}}},
        kafka={"topic_partitions": 1, "partition_concurrency": 1})
    open_counts: list[int] = []
    async with running_bridge(config) as bridge:
        produce(config, topic, [(None, b'{"fail": 1}', []) for _ in range(20)])

        async def sampled() -> bool:
            open_counts.append(await bridge.store.count_open("q"))
            return len(example_log(example_log_path)) >= 20

        await wait_until(sampled, within=90, interval=0.05, what="all 20 records to succeed on their retry")
    assert max(open_counts) <= 6, max(open_counts)  # 5, plus the one record running when the pause came
    assert min(open_counts[len(open_counts) // 2:]) < 5  # it drained, and resumed by itself


async def test_a_full_store_pauses_consumption_and_no_offset_passes_it(kafka: KafkaEnv, tmp_path: Path,
                                                                       unique: str) -> None:
    topic = f"in-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "permanent", "sources": [topic], "dlq_topic": f"dlq-{unique}"}},
        kafka={"topic_partitions": 1})
    async with running_bridge(config) as bridge:
        produce(config, topic, [(None, b"first", [])])
        await await_lag(config, topic, 0)
        await bridge.store.limit_size(await bridge.store.size_bytes())  # the disk is full from now on
        produce(config, topic, [(None, b"x" * 20_000, []) for _ in range(30)])
        await asyncio.sleep(4)
        assert await lag(config, topic) == 30  # nothing committed past the records that could not be stored
        assert (await bridge.store.counts())["q"]["DEAD"] == 1
        await bridge.store.limit_size(None)  # space returns
        await await_lag(config, topic, 0)
        assert (await bridge.store.counts())["q"]["DEAD"] == 31


async def test_a_hung_first_delivery_is_abandoned_after_a_lease_and_ends_in_the_dlq(
        kafka: KafkaEnv, tmp_path: Path, unique: str, example_log_path: Path) -> None:
    from bridge.handler_api import HandlerContext
    from bridge.registry import REGISTRY

    async def hang(ctx: HandlerContext) -> None:
        if ctx.payload == b"hang":
            await asyncio.sleep(3600)  # never heartbeats, never returns
        REGISTRY.get("ok").fn(ctx)  # type: ignore[union-attr]

    registry = REGISTRY.extended({"hang-or-ok": hang})
    topic = f"in-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "hang-or-ok", "sources": [topic], "dlq_topic": f"dlq-{unique}", "lease": "1s",
              "max_attempts": 2, "backoff": {"kind": "fixed", "base": "10ms"}}},
        kafka={"topic_partitions": 1, "partition_concurrency": 1})
    async with running_bridge(config, registry):
        produce(config, topic, [(None, b"hang", []), (None, b"after-1", []), (None, b"after-2", [])])
        [record] = await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", expect=1, timeout=60)
        await await_lag(config, topic, 0)
    # The partition's only slot was freed: the records behind the hung one were handled.
    assert len(example_log(example_log_path)) == 2
    assert [a["outcome"] for a in record.value["attempts"]] == ["LEASE_EXPIRED", "LEASE_EXPIRED"]
    assert record.value["reason"]["type"] == "rdq.LeaseExpired"


async def test_one_dlq_record_that_cannot_be_published_does_not_block_the_others(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """At the head of the outbox: a task too large for the DLQ topic even trimmed (the payload is kept whole),
    and one whose envelope cannot be built (bad data re-created from a crafted DLQ record). They used to be
    retried for ever ahead of all others, and the build error stopped the bridge (a crash loop)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from bridge.admin.commands import AdminCommands
    from bridge.admin.protocol import StatsArgs
    from bridge.model import ErrorInfo
    from bridge.store.tasks import Store
    from tests.helpers import failure

    dlq = f"dlq-{unique}"
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    admin.create_topics([NewTopic(dlq, 1, 1, config={"max.message.bytes": "100000"})])[dlq].result(30)
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "ok", "sources": [f"in-{unique}"], "dlq_topic": dlq}})
    store = await Store.open(config.store.path)
    dead = ErrorInfo("Permanent", "no")
    too_big = failure(payload=b"x" * 300_000, dead=dead, now=1_000)
    unbuildable = failure(dead=dead, now=2_000)
    unbuildable = type(unbuildable)(**{**unbuildable.__dict__, "headers": {**unbuildable.headers,
                                                                            "rdq.kafka.headers": "not json"}})
    fine = [failure(dead=dead, now=3_000 + i) for i in range(3)]
    for task in [too_big, unbuildable, *fine]:
        await store.submit(task)
    await store.close()
    async with running_bridge(config) as bridge:
        records = await aread_dlq(kafka.bootstrap_servers, dlq, expect=3)
        assert sorted(r.headers["rdq.task_id"].decode() for r in records) == sorted(t.id for t in fine)

        async def both_recorded() -> bool:
            stuck = await bridge.store.dlq_stuck()
            return stuck.get("q", {}).get("entries") == 2

        await wait_until(both_recorded, within=30, what="both failures recorded")
        for task_id, why in ((too_big.id, "MSG_SIZE_TOO_LARGE"), (unbuildable.id, "JSONDecodeError")):
            task = await bridge.store.get(task_id)
            assert task is not None and task.dlq_state == "PENDING" and task.dlq_failures >= 1, task_id
            row = await bridge.store.db.read(lambda c, i=task_id: c.execute(
                "SELECT dlq_error, dlq_next_at FROM tasks WHERE id = ?", (i,)).fetchone())
            assert why in row[0] and row[1] > bridge.engine.clock.now_ms(), row[0]  # waits for its own retry
        stats = await AdminCommands(bridge.engine, lambda t, p, o: None).stats(StatsArgs(), None, None)  # type: ignore[arg-type]
        assert stats["dlq_stuck"] == {"q": {"entries": 2, "most_failures": 1}}
        metrics = bridge.telemetry.metrics.registry
        await wait_until(lambda: metrics.get_sample_value("rdq_dlq_stuck", {"queue": "q"}) == 2, within=10,
                         what="the stuck gauge")
        assert [p for p in asyncio.all_tasks() if p.get_name() == "rdq-dlq" and p.done()] == []  # still publishing


async def test_a_dlq_batch_read_ahead_that_fails_is_read_again_and_nothing_is_left(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """The publisher reads the next batch while this one goes out. A read ahead that fails (the store unreadable
    for a moment) is dropped and read again: awaited again each round, its failure stalled the outbox for good."""
    from bridge.model import ErrorInfo
    from bridge.store.database import StoreError
    from tests.helpers import failure

    dlq = f"dlq-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "ok", "sources": [f"in-{unique}"], "dlq_topic": dlq}})
    async with running_bridge(config) as bridge:
        bridge.dlq.batch = 4
        real_read = bridge.store.dlq_outbox_entries
        after_full: list[bool] = []
        failed = 0

        async def read(*args: object, **kw: object) -> list[object]:
            nonlocal failed
            if after_full and not failed:
                failed += 1
                raise StoreError("disk I/O error")
            entries = await real_read(*args, **kw)  # type: ignore[arg-type]
            if len(entries) == 4:
                after_full.append(True)
            return entries  # type: ignore[return-value]

        bridge.store.dlq_outbox_entries = read  # type: ignore[method-assign,assignment]
        tasks = [failure(dead=ErrorInfo("Permanent", "no"), now=1_000 + i) for i in range(10)]
        assert await bridge.store.submit_many(tasks) == [None] * 10
        await wait_until(lambda: bridge.dlq.published == 10, within=30, what="every entry published")
        assert failed == 1
    records = await aread_dlq(kafka.bootstrap_servers, dlq)
    assert sorted(r.headers["rdq.task_id"].decode() for r in records) == sorted(t.id for t in tasks)  # once each


async def test_a_dlq_publish_the_store_cannot_record_yet_is_not_sent_twice(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """The broker acknowledged the DLQ record, but the store could not record it (a full disk fails the whole
    group commit the mark is in). The mark is retried; the record was sent again each round (duplicates)."""
    from bridge.model import ErrorInfo
    from bridge.store.database import StoreError
    from bridge.store.tasks import Store
    from tests.helpers import failure

    dlq = f"dlq-{unique}"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "ok", "sources": [f"in-{unique}"], "dlq_topic": dlq}})
    store = await Store.open(config.store.path)
    tasks = [failure(dead=ErrorInfo("Permanent", "no"), now=1_000 + i) for i in range(5)]
    for task in tasks:
        await store.submit(task)
    await store.close()
    full = True
    tries = 0
    async with running_bridge(config) as bridge:
        real_mark = bridge.store.mark_dlq_published_many

        async def mark(*args: object, **kw: object) -> int:
            nonlocal tries
            if full:
                tries += 1
                raise StoreError("database or disk is full")
            return await real_mark(*args, **kw)  # type: ignore[arg-type]

        bridge.store.mark_dlq_published_many = mark  # type: ignore[method-assign]
        await aread_dlq(kafka.bootstrap_servers, dlq, expect=5)
        await wait_until(lambda: tries >= 6, within=30, what="marks retried meanwhile")
        full = False
        await wait_until(lambda: bridge.dlq.published == 5, within=30, what="marks recorded once space returns")
        assert await bridge.store.dlq_outbox() == []
    records = await aread_dlq(kafka.bootstrap_servers, dlq)
    assert sorted(r.headers["rdq.task_id"].decode() for r in records) == sorted(t.id for t in tasks)  # once each
