"""`rdq import` and `rdq dlq tail` on a real broker (SPEC §13): records written by a real producer in each foreign
format become DEAD tasks with their history; an import run twice makes no second task; an imported task redrives
and runs its handler; the tail prints every record, readable or not. (One test: one bridge, one setup.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.config import BridgeConfig
from bridge.dlq.foreign import IMPORTED_FORMAT
from bridge.model import Status
from bridge.records import SOURCE
from tests.conftest import KafkaEnv
from tests.kafka_helpers import aread_dlq, produce, read_topic, running_bridge, wait_until
from tests.test_admin import QUEUE, ROOT, admin_config, dead_task, switch_registry, write
from tests.test_foreign_dlq import CONNECT_HEADERS, SHARE_HEADERS, spring_headers

pytestmark = pytest.mark.kafka


async def cli(config: BridgeConfig, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "bridge.cli", *args[:1], *(["tail"] if args[0] == "dlq" else []),
        "--config", str(write(config, tmp_path)), *args[1:]], capture_output=True, text=True, cwd=ROOT, timeout=180)
    return proc.returncode, proc.stdout, proc.stderr


def legacy_records(unique: str) -> list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]]:
    # First, a Spring record whose timestamp header is 0x7fff…ff: it once raised OverflowError and the rest of the
    # range was never imported. Now it is refused alone, with its reason.
    broken = [(k, b"\x7f" + b"\xff" * 7 if k == "kafka_dlt-original-timestamp" else v)
              for k, v in spring_headers(partition=0, offset=10)]
    return [
        (b"acct-0", b'{"n": 0}', broken),
        (b"acct-1", b'{"n": 1}', spring_headers(partition=0, offset=11)),
        (b"acct-2", b'{"n": 2}', CONNECT_HEADERS),
        (b"acct-3", b'{"n": 3}', SHARE_HEADERS),
        (b"acct-4", b"garbage that no system wrote as a dead letter", [("x-app", b"1")]),
    ]


async def test_import_every_format_once_redrive_an_imported_task_and_tail_the_dlqs(kafka: KafkaEnv, tmp_path: Path,
                                                                                   unique: str) -> None:
    registry, switch = switch_registry()
    legacy = f"legacy-dlq-{unique}"
    # The foreign records died two hours ago, longer than the queue keeps a finished task: kept from their death,
    # the sweep purged each imported task again at once (a second import found none of them).
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"],
                                                          "dlq_topic": f"dlq-{unique}", "task_ttl": "1h"}})
    async with running_bridge(config, registry) as bridge:
        # One of this project's own envelopes too: a task of this bridge, dead-lettered, then purged.
        [own_id] = await dead_task(bridge, config, f"in-{unique}")
        [own] = await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", expect=1)
        await wait_until(lambda: bridge.dlq.published == 1, what="publish recorded")
        await bridge.store.purge_task(own_id)
        _create(config, legacy)
        produce(config, legacy, [*legacy_records(unique), (None, json.dumps(own.value).encode(), [])],
                timestamp=int(time.time() * 1000) - 2 * 3600_000)

        code, out, err = await cli(config, tmp_path, "import", "--topic", legacy, "--queue", "q", "--dry-run",
                                   "--json")
        assert code == 0, err
        dry = json.loads(out)
        assert dry["imported"] == 4 and dry["refused"] == 2 and await bridge.store.counts() == {}
        code, out, err = await cli(config, tmp_path, "import", "--topic", legacy, "--queue", "q", "--dry-run",
                                   "--error-type", "DataException", "--json")  # by class name alone
        only = json.loads(out)
        assert code == 0 and only["imported"] == 1 and only["formats"] == {"kafka-connect": 1}, out + err
        assert only["filtered"] == 3 and only["unclaimed"] == 0 and only["refused"] == 2

        code, out, err = await cli(config, tmp_path, "import", "--topic", legacy, "--queue", "q", "--json")
        assert code == 0, err
        first = json.loads(out)
        assert first["records"] == 6 and first["imported"] == 4 and first["unclaimed"] == 0
        assert first["formats"] == {"spring-kafka": 1, "kafka-connect": 1, "share-group": 1, "rdq": 1}
        overflow, unknown = sorted(first["refusals"], key=lambda r: r["offset"])
        assert overflow["offset"] == 0 and "out of range for a timestamp" in overflow["reason"]
        assert unknown["offset"] == 4 and "unknown format" in unknown["reason"]

        tasks = {t.headers.get(IMPORTED_FORMAT): t for t in await bridge.store.list_tasks("q", Status.DEAD)}
        assert set(tasks) == {"spring-kafka", "kafka-connect", "share-group", "rdq"}
        spring = await bridge.store.get(tasks["spring-kafka"].id)
        assert spring is not None and spring.headers[SOURCE] == "kafka://orders/0/11"
        assert spring.attempts[0].error is not None and "Billing.java" in (spring.attempts[0].error.stack or "")
        assert tasks["rdq"].id == own_id  # our envelope keeps its id

        await asyncio.sleep(0.5)  # five sweeps
        code, out, err = await cli(config, tmp_path, "import", "--topic", legacy, "--queue", "q", "--json")
        again = json.loads(out)
        assert code == 0 and again["imported"] == 0 and again["exists"] == 4, (out, err)
        assert (await bridge.store.counts())["q"]["DEAD"] == 4

        switch.fixed = True
        code, out, err = await cli(config, tmp_path, "redrive", "--task", spring.id, "--json")
        assert code == 0, err

        async def ran() -> bool:
            task = await bridge.store.get(spring.id)
            return task is not None and task.status == Status.SUCCEEDED

        await wait_until(ran, what="the imported task to run after its redrive")
        assert any(call[0] == spring.id for call in switch.calls)

    # rdq dlq tail, for people: our own DLQ record with its attempts, source and trace.
    code, out, err = await cli(config, tmp_path, "dlq", "--topic", f"dlq-{unique}")
    assert code == 0, err
    assert f"task {own_id}  queue q  (rdq)" in out
    assert "attempt 1" in out and "attempt 2" in out and "ConnectionError: downstream is down" in out
    assert f"trace {'ab' * 16}" in out and f"source kafka://in-{unique}/" in out
    # --last N on a DLQ written in Kafka transactions: the last offsets are commit markers, not records.
    code, out, err = await cli(config, tmp_path, "dlq", "--topic", f"dlq-{unique}", "--last", "1")
    assert code == 0 and f"task {own_id}" in out, out + err
    # For scripts, every record of the foreign topic, readable or not.
    code, out, err = await cli(config, tmp_path, "dlq", "--topic", legacy, "--json")
    assert code == 0, err
    entries: list[dict[str, Any]] = [json.loads(line) for line in out.splitlines()]
    assert [e.get("format") for e in entries] == [None, "spring-kafka", "kafka-connect", "share-group", None, "rdq"]
    assert "out of range" in entries[0]["unreadable"]  # shown, with its reason, and the tail goes on
    assert "unknown format" in entries[4]["unreadable"] and entries[5]["task_id"] == own_id
    assert entries[1]["source"] == "kafka://orders/0/11" and entries[1]["attempts"][0]["outcome"]
    assert entries[1]["trace_id"] is None  # the record carries none: no trace is made up for it


def _create(config: BridgeConfig, topic: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": config.kafka.bootstrap_servers})
    for future in admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)]).values():
        future.result(30)


async def test_an_import_into_a_partition_never_consumed_reaches_the_changelog(kafka: KafkaEnv, tmp_path: Path,
                                                                              unique: str) -> None:
    """No record of the source was ever consumed (no committed offset): the changelog writer had no offsets to send
    with its transaction and refused every round holding the imported tasks, so they lived in SQLite only (lost
    with the disk, dropped by the next owner) and DLQ publishes queued behind them stalled."""
    from tests.test_changelog_kafka import changelog_states

    registry, _ = switch_registry()
    legacy = f"legacy-dlq-{unique}"
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"]}},
                          kafka={"topic_partitions": 1})
    async with running_bridge(config, registry) as bridge:
        _create(config, legacy)
        connect = [(k, b"0" if k == "__connect.errors.partition" else v) for k, v in CONNECT_HEADERS]
        connect = [(k, f"in-{unique}".encode() if k == "__connect.errors.topic" else v) for k, v in connect]
        produce(config, legacy, [(b"acct-9", b'{"n": 9}', connect)])
        await wait_until(lambda: not bridge.consumer.restoring and bridge.consumer.owns(f"in-{unique}", 0),
                         what="the partition restored")
        code, out, err = await cli(config, tmp_path, "import", "--topic", legacy, "--queue", "q", "--json")
        assert code == 0 and json.loads(out)["imported"] == 1, out + err
        [task] = await bridge.store.list_tasks("q", Status.DEAD)
        assert bridge.changelog is not None
        local = bridge.changelog.local

        async def logged() -> bool:
            return not await local.unlogged([task.id])

        await wait_until(logged, within=30, what="the imported task in the changelog")
    states = await asyncio.to_thread(changelog_states, config, f"in-{unique}")
    assert states[task.id]["task"]["status"] == "DEAD"


def _share_group_rejects(bootstrap: str, source: str, group: str, expect: int) -> None:
    """A real share group (KIP-932) that rejects every record it gets: Kafka writes each to the group's DLQ."""
    from confluent_kafka import AcknowledgeType, ShareConsumer

    consumer = ShareConsumer({"bootstrap.servers": bootstrap, "group.id": group,
                              "share.acknowledgement.mode": "explicit"})
    consumer.subscribe([source])
    rejected = 0
    deadline = time.monotonic() + 60
    try:
        while rejected < expect and time.monotonic() < deadline:
            messages = consumer.poll(1.0) or []
            for msg in messages:
                if msg.error() is None:
                    consumer.acknowledge(msg, AcknowledgeType.REJECT)
                    rejected += 1
            if messages:
                consumer.commit_sync()
    finally:
        consumer.close()
    assert rejected == expect, rejected


async def test_import_a_kafka_44_share_group_dlq_of_pointers_and_redrive_the_original_payloads(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """Kafka 4.4's share-group DLQ (KIP-1191) writes pointer-only records by default: `__dlq.errors.*` headers, no
    value. The import reads each original (value, key, headers) from its source topic; a redrive then runs the
    handler on the original payload, not on nothing. A pointer whose original is gone is refused, saying so."""
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AdminClient,
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        NewTopic,
        ResourceType,
    )

    registry, switch = switch_registry()
    source, dlq, group = f"orders-{unique}", f"dlq.share-{unique}", f"share-{unique}"  # the share group's topic
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"]}},
                          kafka={"topic_partitions": 1})
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    for future in admin.create_topics([NewTopic(source, 1, 1), NewTopic(
            dlq, 1, 1, config={"errors.deadletterqueue.group.enable": "true"})]).values():
        future.result(30)
    settings = ConfigResource(ResourceType.GROUP, group, incremental_configs=[
        ConfigEntry("errors.deadletterqueue.topic.name", dlq, incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("share.auto.offset.reset", "earliest", incremental_operation=AlterConfigOpType.SET)])
    for future in admin.incremental_alter_configs([settings]).values():
        future.result(30)
    produce(config, source, [(f"acct-{i}".encode(), json.dumps({"n": i}).encode(), [("app-header", b"kept")])
                             for i in range(4)])
    await asyncio.to_thread(_share_group_rejects, kafka.bootstrap_servers, source, group, 4)
    pointers = await asyncio.to_thread(read_topic, kafka.bootstrap_servers, dlq, 2.0, 60.0, 4)
    assert len(pointers) == 4 and all(m.value() is None for m in pointers)
    assert dict(pointers[0].headers())["__dlq.errors.message"] == b"Offset rejected by client."
    # The original of the first is gone (deleted by retention, as it would be in time).
    from confluent_kafka import TopicPartition

    for future in admin.delete_records([TopicPartition(source, 0, 1)]).values():
        future.result(30)

    # Now the bridge, with a queue of its own: it imports the share group's DLQ into it.
    async with running_bridge(config, registry) as bridge:
        code, out, err = await cli(config, tmp_path, "import", "--topic", dlq, "--queue", "q", "--json")
        assert code == 0, out + err
        summary = json.loads(out)
        assert summary["imported"] == 3 and summary["formats"] == {"share-group": 3}, summary
        [gone] = summary["refusals"]
        assert gone["offset"] == 0 and "is gone" in gone["reason"] and f"kafka://{source}/0/0" in gone["reason"]
        tasks = {json.loads(t.payload)["n"]: t for t in await bridge.store.list_tasks("q", Status.DEAD)}
        assert sorted(tasks) == [1, 2, 3]
        one_task = await bridge.store.get(tasks[1].id)
        assert one_task is not None and one_task.headers[SOURCE] == f"kafka://{source}/0/1"
        assert one_task.attempts[0].note is not None and f"share group {group}" in one_task.attempts[0].note
        switch.fixed = True
        code, out, err = await cli(config, tmp_path, "redrive", "--queue", "q", "--rate", "100", "--json")
        assert code == 0, out + err

        async def all_ran() -> bool:
            counts = (await bridge.store.counts()).get("q", {})
            return counts.get("SUCCEEDED", 0) == 3

        await wait_until(all_ran, what="the redriven originals to succeed")
    assert {call[0] for call in switch.calls} == {t.id for t in tasks.values()}


def test_offsets_that_cannot_be_read_end_in_one_line_not_a_traceback() -> None:
    """`rdq import` (and the console's import) asks each partition's offsets; a partition without a leader (a topic
    just created, a broker coming back: `_UNKNOWN_PARTITION`) is asked again, and one that stays unreadable is a
    one-line error naming the topic and partition — it once ended `rdq import` with a KafkaException traceback."""
    from confluent_kafka import Consumer

    from bridge.cli.imports import _offsets
    from bridge.config import ConfigError

    consumer = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "rdq-import-test",
                         "socket.connection.setup.timeout.ms": 1000, "log_level": 0})
    try:
        began = time.monotonic()
        with pytest.raises(ConfigError, match=r"topic 'legacy\.dlq' partition 3: its offsets cannot be read"):
            _offsets(consumer, "legacy.dlq", 3, within=1.0)
        assert time.monotonic() - began < 30
    finally:
        consumer.close()
