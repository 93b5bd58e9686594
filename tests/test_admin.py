"""The admin topic and the rdq CLI on a real broker (SPEC §7)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.admin.client import AdminClientError, AdminSession
from bridge.admin.protocol import encode_command, sign
from bridge.cli.main import main as cli_main
from bridge.config import BridgeConfig
from bridge.handler_api import HandlerContext
from bridge.kafka_clients import ensure_topics
from bridge.registry import Registry
from tests.conftest import KafkaEnv
from tests.kafka_helpers import aread_dlq, kafka_config, produce, read_topic, running_bridge, wait_until

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parent.parent
KEYS = {"k1": "first-secret-of-32-bytes-or-more-1", "k2": "rotated-secret-of-32-bytes-or-more"}


def admin_config(env: KafkaEnv, tmp_path: Path, unique: str, queues: dict[str, Any], **extra: Any) -> BridgeConfig:
    return kafka_config(env.bootstrap_servers, tmp_path, unique, queues,
                        admin={"topic": f"admin-{unique}", "reply_topic": f"replies-{unique}",
                               "auth": {"keys": KEYS, "signing_key": "k2"}}, **extra)


async def ask(config: BridgeConfig, command: str, args: dict[str, Any], instances: int = 1,
              within: float = 15.0) -> list[dict[str, Any]]:
    def run() -> list[dict[str, Any]]:
        session = AdminSession(config, issued_by="sre@test")
        try:
            return session.request(command, args, timeout=within, instances=instances).final
        finally:
            session.close()

    return await asyncio.to_thread(run)


async def one(config: BridgeConfig, command: str, args: dict[str, Any]) -> dict[str, Any]:
    [reply] = await ask(config, command, args)
    assert reply["ok"], reply
    return reply["result"]  # type: ignore[no-any-return]


class Switch:
    """A handler that fails until fixed: the incident, then the fix, then the redrive."""

    def __init__(self) -> None:
        self.fixed = False
        self.calls: list[tuple[str, int, int, str]] = []

    def __call__(self, ctx: HandlerContext) -> None:
        self.calls.append((ctx.task_id, ctx.redrive_count, ctx.attempt, ctx.headers.get("traceparent", "")))
        if not self.fixed:
            raise ConnectionError("downstream is down")


def switch_registry() -> tuple[Registry, Switch]:
    registry, switch = Registry(), Switch()
    registry.register("switch", switch)
    registry.register("permanent", lambda ctx: (_ for _ in ()).throw(ValueError("bad record")))
    return registry, switch


QUEUE = {"handler": "switch", "max_attempts": 2, "backoff": {"kind": "fixed", "base": "10ms"}}


async def dead_task(bridge: Any, config: BridgeConfig, topic: str, n: int = 1) -> list[str]:
    produce(config, topic, [(f"k{i}".encode(), b"{}", [("traceparent", f"00-{'ab' * 16}-{'cd' * 8}-01".encode())])
                            for i in range(n)])

    async def all_dead() -> bool:
        counts = await bridge.store.counts()
        return counts.get("q", {}).get("DEAD", 0) >= n

    await wait_until(all_dead, what=f"{n} DEAD tasks")
    return [t.id for t in await bridge.store.list_tasks("q")]


async def test_redrive_by_id_with_pause_and_resume(kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    registry, switch = switch_registry()
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"]}})
    async with running_bridge(config, registry) as bridge:
        [task_id] = await dead_task(bridge, config, f"in-{unique}")
        assert await one(config, "pause", {"queue": "q"}) == {"queue": "q", "paused": True}
        switch.fixed = True
        result = await one(config, "redrive", {"task_id": task_id})
        assert result["redriven"] == [task_id]
        task = (await one(config, "get", {"task_id": task_id}))["task"]
        assert task["status"] == "PENDING" and task["attempt_count"] == 0 and task["redrive_count"] == 1
        assert [a["outcome"] for a in task["attempts"]] == ["RETRYABLE_FAILURE"] * 2  # history kept
        assert task["redrives"][0]["by"] == "sre@test" and task["redrives"][0]["request_id"]
        assert task["redrives"][0]["key_id"] == "k2"  # the verified key that signed it, beside who said they did
        await asyncio.sleep(1.0)
        assert (await bridge.store.get(task_id)).status == "PENDING"  # type: ignore[union-attr]  # paused
        assert await one(config, "resume", {"queue": "q"}) == {"queue": "q", "paused": False}
        await wait_until(lambda: bridge.store.get(task_id), what="task")

        async def succeeded() -> bool:
            t = await bridge.store.get(task_id)
            return t is not None and t.status == "SUCCEEDED"

        await wait_until(succeeded, what="the redriven task to succeed")
    task_id_seen, redrives, attempt, traceparent = switch.calls[-1]
    assert (task_id_seen, redrives, attempt) == (task_id, 1, 1)
    assert traceparent == f"00-{'ab' * 16}-{'cd' * 8}-01"  # the same trace across the redrive


async def test_filtered_redrive_with_and_without_dry_run(kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    registry, switch = switch_registry()
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"]}})
    async with running_bridge(config, registry) as bridge:
        ids = await dead_task(bridge, config, f"in-{unique}", 3)
        dry = await one(config, "redrive", {"queue": "q", "error_type": "ConnectionError", "dry_run": True})
        assert sorted(dry["matched"]) == sorted(ids) and dry["dry_run"]
        assert (await bridge.store.counts())["q"]["DEAD"] == 3
        none = await one(config, "redrive", {"queue": "q", "error_type": "rdq.Timeout"})
        assert none["count"] == 0
        switch.fixed = True
        done = await one(config, "redrive", {"queue": "q", "error_type": "ConnectionError", "limit": 2,
                                             "dead_since": "2020-01-01T00:00:00Z"})
        assert done["count"] == 2

        async def two_succeeded() -> bool:
            return (await bridge.store.counts())["q"]["SUCCEEDED"] == 2

        await wait_until(two_succeeded, what="two redriven tasks to succeed")


def dlq_config(kafka: KafkaEnv, tmp_path: Path, unique: str) -> BridgeConfig:
    return admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"],
                                                        "dlq_topic": f"dlq-{unique}"}})


async def purged_from_the_store(kafka: KafkaEnv, bridge: Any, config: BridgeConfig, unique: str) -> tuple[str, Any]:
    """A task dead-lettered, published to the DLQ, then purged from the store: (its id, its DLQ record)."""
    [task_id] = await dead_task(bridge, config, f"in-{unique}")
    [record] = await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", expect=1)
    await wait_until(lambda: bridge.dlq.published == 1, what="publish recorded")
    assert (await one(config, "purge", {"task_id": task_id}))["purged"] == 1
    assert await bridge.store.get(task_id) is None
    return task_id, record


async def test_redrive_from_a_dlq_record_after_the_store_purged_it(kafka: KafkaEnv, tmp_path: Path,
                                                                  unique: str) -> None:
    registry, switch = switch_registry()
    config = dlq_config(kafka, tmp_path, unique)
    async with running_bridge(config, registry) as bridge:
        task_id, record = await purged_from_the_store(kafka, bridge, config, unique)
        switch.fixed = True
        ref = f"dlq-{unique}/{record.partition}/{record.offset}"
        proc = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "bridge.cli", "redrive", "--config", str(write(config, tmp_path)),
            "--from-dlq", ref, "--instances", "1", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=90)
        assert proc.returncode == 0, proc.stderr
        [reply] = json.loads(proc.stdout)
        assert reply["result"]["recreated"] and reply["result"]["redriven"] == [task_id]

        async def succeeded() -> bool:
            t = await bridge.store.get(task_id)
            return t is not None and t.status == "SUCCEEDED"

        await wait_until(succeeded, what="the re-created task to succeed")
        task = await bridge.store.get(task_id)
        assert task is not None and task.redrive_count == 1 and len(task.attempts) == 3  # 2 from the envelope


async def test_a_redrive_from_the_dlq_that_loses_a_race_after_the_re_creation_says_so(
        kafka: KafkaEnv, tmp_path: Path, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-created from its DLQ record, the task is DEAD in the store; if another redrive or a purge reaches it
    before this one's own redrive (the redrive here refuses, as it would then), the reply names what happened
    instead of a bare count of 0, and the re-created task stays, DEAD, for the next try."""
    registry, _ = switch_registry()
    config = dlq_config(kafka, tmp_path, unique)
    async with running_bridge(config, registry) as bridge:
        task_id, record = await purged_from_the_store(kafka, bridge, config, unique)

        async def lost_the_race(*args: Any, **kwargs: Any) -> bool:
            return False

        monkeypatch.setattr(bridge.engine, "redrive", lost_the_race)
        result = await one(config, "redrive", {"dlq": {"topic": f"dlq-{unique}", "partition": record.partition,
                                                       "offset": record.offset}})
        assert result["recreated"] and result["redriven"] == [] and result["count"] == 0, result
        assert f"task {task_id} was re-created DEAD" in result["note"] and "no longer DEAD" in result["note"]
        task = await bridge.store.get(task_id)
        assert task is not None and task.status == "DEAD"


def write(config: BridgeConfig, tmp_path: Path) -> Path:
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(config.file_tree()))
    return path


async def test_two_instances_both_answer_stats_and_the_cli_returns_once_both_did(kafka: KafkaEnv, tmp_path: Path,
                                                                                  unique: str) -> None:
    """Both instances answer. Without `--instances`, a request ends when as many instances answered as the
    bridges' consumer group has members — not at `--timeout` (it waited its whole 5 s before, though both
    answered in milliseconds)."""
    registry, _ = switch_registry()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    queues = {"q": {**QUEUE, "sources": [f"in-{unique}"]}}
    config_a = admin_config(kafka, tmp_path / "a", unique, queues)
    config_b = admin_config(kafka, tmp_path / "b", unique, queues)
    async with running_bridge(config_a, registry, instance_id="bridge-a"), \
            running_bridge(config_b, registry, instance_id="bridge-b"):
        replies = await ask(config_a, "stats", {}, instances=2)

        def members() -> int | None:
            session = AdminSession(config_a, issued_by="sre@test")
            try:
                return session.group_size()
            finally:
                session.close()

        async def both_in_the_group() -> bool:
            return await asyncio.to_thread(members) == 2

        await wait_until(both_in_the_group, within=60, what="both bridges in the group")

        def stats() -> tuple[list[dict[str, Any]], float]:
            session = AdminSession(config_a, issued_by="sre@test")
            try:
                began = time.monotonic()
                final = session.request("stats", {}, timeout=120).final
                return final, time.monotonic() - began
            finally:
                session.close()

        early, took = await asyncio.to_thread(stats)
    assert sorted(r["instance"] for r in replies) == ["bridge-a", "bridge-b"]
    assert all(r["ok"] and r["result"]["configured"] == ["q"] for r in replies)
    assert sorted(r["instance"] for r in early) == ["bridge-a", "bridge-b"]
    assert took < 60, took  # ended by the answers, not by the 120 s timeout


@pytest.mark.parametrize("changelog", [True, False], ids=["changelog", "no-changelog"])
async def test_redrive_from_a_dlq_record_is_carried_out_by_exactly_one_instance(
        kafka: KafkaEnv, tmp_path: Path, unique: str, changelog: bool) -> None:
    """No store holds the task: the instance owning its home partition re-creates it; the other refuses with a
    reason (it answered `ok: true, count: 0`, which a script reads as success). With the changelog (SPEC §10) the
    owner is the only one that may (a task lives with its partition), and a record whose partition is gone goes
    home to the partition its key chooses; without it, naming an instance overrides."""
    from bridge.dlq.envelope import build_record
    from bridge.model import Attempt, ErrorInfo, Outcome, Status, Task, new_task_id

    registry, switch = switch_registry()
    # Fixed: a re-created task runs and stays (SUCCEEDED). Still failing, it died again within ~20 ms (2 attempts,
    # 10 ms apart), was dead-lettered and purged before the test could look for it (one make test run: None).
    switch.fixed = True
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    queues = {"q": {**QUEUE, "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}"}}
    store = {"store": {"changelog": changelog}}
    config_a = admin_config(kafka, tmp_path / "a", unique, queues, **store)
    config_b = admin_config(kafka, tmp_path / "b", unique, queues, **store)

    def envelope(partition: int, key: str = "") -> bytes:
        task = Task(new_task_id(), "q", "switch", None, b"{}", "application/json",
                    {"rdq.source": f"kafka://in-{unique}/{partition}/0", "rdq.kafka.key": key}, Status.DEAD, 2, 0,
                    None, None, 0, None, None, 1_000, 1_000, 2_000, None, ErrorInfo("ConnectionError", "down"),
                    "PUBLISHED", None, None, None,
                    (Attempt(1, 0, 1_000, 1_100, Outcome.RETRYABLE_FAILURE, ErrorInfo("ConnectionError")),))
        return build_record(task, 1_000_000).value

    async with running_bridge(config_a, registry, instance_id="bridge-a") as a, \
            running_bridge(config_b, registry, instance_id="bridge-b") as b:
        def split() -> tuple[frozenset[Any], frozenset[Any]] | None:
            if (len(a.consumer.assigned) + len(b.consumer.assigned) == 3 and a.consumer.assigned
                    and b.consumer.assigned and not a.consumer.restoring and not b.consumer.restoring):
                return frozenset(a.consumer.assigned), frozenset(b.consumer.assigned)
            return None

        seen: list[Any] = []

        async def settled() -> bool:  # the same split for 2 s: the group's rebalances are over
            seen.append(split())
            return len(seen) > 20 and seen[-1] is not None and len(set(seen[-21:])) == 1

        await wait_until(settled, what="both instances assigned, the group settled")
        owned_by_a = sorted(p for _, p in a.consumer.assigned)[0]
        produce(config_a, f"dlq-{unique}", [(None, envelope(owned_by_a), []), (None, envelope(owned_by_a), []),
                                            (None, envelope(7, "a2V5"), [])])
        # In the order produced (the DLQ topic has several partitions: the read order is not that order).
        records = sorted(await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", expect=3),
                         key=lambda r: r.value["task"]["headers"]["rdq.source"].endswith("/7/0"))
        first, second, gone = ({"dlq": {"topic": f"dlq-{unique}", "partition": r.partition, "offset": r.offset}}
                               for r in records)
        replies = {r["instance"]: r for r in await ask(config_a, "redrive", first, instances=2)}
        assert replies["bridge-a"]["ok"] and replies["bridge-a"]["result"]["recreated"]
        assert replies["bridge-a"]["result"]["count"] == 1, replies["bridge-a"]  # redriven too: not purged between
        refusal = "rdq.admin.NotOwner" if changelog else "rdq.admin.NotHeld"
        assert not replies["bridge-b"]["ok"] and replies["bridge-b"]["error"]["type"] == refusal
        task_id = records[0].value["task"]["id"]
        # a re-created it and ran it (the task itself may be gone already: finished and purged); b never had it.
        await wait_until(lambda: any(call[0] == task_id for call in switch.calls), within=30, what="a ran it")
        assert await b.store.get(task_id) is None
        second["instance"] = "bridge-b"
        replies = {r["instance"]: r for r in await ask(config_a, "redrive", second, instances=2)}
        assert not replies["bridge-a"]["ok"] and replies["bridge-a"]["error"]["type"] == "rdq.admin.NotChosen"
        if not changelog:
            assert replies["bridge-b"]["ok"] and replies["bridge-b"]["result"]["recreated"]
            return
        # Named but not the owner: it refuses too (it would run a task whose partition another instance owns).
        assert not replies["bridge-b"]["ok"] and replies["bridge-b"]["error"]["type"] == "rdq.admin.NotOwner", (
            replies["bridge-b"], owned_by_a)
        # Partition 7 does not exist: the key chooses its home among the topic's 3 partitions.
        home = zlib.crc32(b"key") % 3
        owner, other = ("bridge-a", "bridge-b") if (f"in-{unique}", home) in a.consumer.assigned else \
            ("bridge-b", "bridge-a")
        replies = {r["instance"]: r for r in await ask(config_a, "redrive", gone, instances=2)}
        assert replies[owner]["ok"] and replies[owner]["result"]["home"] == f"in-{unique}/{home}"
        assert replies[other]["error"]["type"] == "rdq.admin.NotOwner"


async def test_set_policy_changes_what_queued_tasks_do(kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    registry, switch = switch_registry()
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "max_attempts": 50, "sources": [f"in-{unique}"],
                                                          "backoff": {"kind": "fixed", "base": "2s"}}})
    async with running_bridge(config, registry) as bridge:
        produce(config, f"in-{unique}", [(b"k", b"{}", [])])
        await wait_until(lambda: bridge.store.counts(), what="a task")
        policy = {"max_attempts": 2, "backoff": {"kind": "fixed", "base": "10ms"}}
        result = await one(config, "set-policy", {"queue": "q", "policy": policy})
        assert result["policy"]["max_attempts"] == 2
        calls_when_applied = len(switch.calls)

        async def dead() -> bool:
            return (await bridge.store.counts()).get("q", {}).get("DEAD", 0) == 1

        await wait_until(dead, what="the queued task to obey the new policy")
        bad = await ask(config, "set-policy", {"queue": "q", "policy": {"max_attempts": 0}})
        assert not bad[0]["ok"] and bad[0]["error"]["type"] == "rdq.admin.InvalidArgs"
        settings_ = await bridge.store.queue_settings()
        assert settings_["q"][0] == {"max_attempts": 2, "backoff": {"kind": "fixed", "base": "10ms"}}  # persisted
    # Under the file's policy it would run 50 times. It died at the first failure after the change (one attempt
    # may have been running when the command landed; how many ran before depends on when the command was read).
    assert len(switch.calls) <= calls_when_applied + 1 and len(switch.calls) < 50


class RawAdmin:
    """Sends raw admin records (as kcat would) and reads every reply."""

    def __init__(self, config: BridgeConfig) -> None:
        assert config.admin is not None
        self.config, self.admin = config, config.admin
        self.producer = Producer({"bootstrap.servers": config.kafka.bootstrap_servers})

    def send(self, value: bytes, headers: list[tuple[str, bytes]] | None = None) -> None:
        self.producer.produce(self.admin.topic, value=value, headers=headers or [])
        assert self.producer.flush(15) == 0

    def signed(self, command: str, args: dict[str, Any], **kw: Any) -> str:
        request_id, value, headers = encode_command(command, args, "raw@test", self.admin.auth, **kw)
        self.send(value, headers)
        return request_id

    def replies(self, expect: int, within: float = 30.0) -> list[dict[str, Any]]:
        consumer = Consumer({"bootstrap.servers": self.config.kafka.bootstrap_servers,
                             "group.id": f"r-{uuid.uuid4().hex}", "auto.offset.reset": "earliest"})
        consumer.subscribe([self.admin.reply_topic])
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + within
        while len(out) < expect and time.monotonic() < deadline:
            out += [json.loads(m.value()) for m in consumer.consume(100, 0.5) if m.error() is None]
        consumer.close()
        return out


async def test_forged_and_broken_commands_are_refused_with_a_reason(kafka: KafkaEnv, tmp_path: Path,
                                                                    unique: str) -> None:
    registry, _ = switch_registry()
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"]}},
                          kafka={"topic_partitions": 1})
    raw = RawAdmin(config)
    async with running_bridge(config, registry) as bridge:
        def send_all() -> dict[str, str]:
            ids = {"ok-before": raw.signed("stats", {})}
            _, value, _ = encode_command("stats", {}, "x", "none", request_id="unsigned")
            raw.send(value)
            auth = config.admin.auth  # type: ignore[union-attr]
            _, value, headers = encode_command("stats", {}, "x", auth, request_id="bad-sig")
            raw.send(value + b" ", headers)  # the signature no longer matches the bytes
            _, value, _ = encode_command("stats", {}, "x", "none", request_id="unknown-key")
            raw.send(value, [("rdq.key_id", b"k9"), ("rdq.signature", sign("guess", value).encode())])
            ids["stale"] = raw.signed("stats", {}, request_id="stale", issued_at="2020-01-01T00:00:00.000Z")
            ids["replayed"] = raw.signed("stats", {}, request_id="replayed")
            _, value, headers = encode_command("stats", {}, "x", auth, request_id="replayed")
            raw.send(value, headers)
            junk = b"\xff\xfe not json"
            raw.send(junk, [("rdq.key_id", b"k1"), ("rdq.signature", sign(KEYS["k1"], junk).encode())])
            raw.signed("drop-tables", {}, request_id="unknown-command")
            raw.signed("get", {"nope": 1}, request_id="bad-args")
            raw.signed("stats", {}, request_id="old-key", key_id="k1")  # rotation: both keys verify
            ids["ok-after"] = raw.signed("stats", {})
            return ids

        ids = await asyncio.to_thread(send_all)
        replies = await asyncio.to_thread(raw.replies, 12)
        assert bridge.admin is not None
    by_id: dict[Any, list[dict[str, Any]]] = {}
    for r in replies:
        by_id.setdefault(r["request_id"], []).append(r)
    kinds = {rid: [r["error"]["type"] if not r["ok"] else "ok" for r in rs] for rid, rs in by_id.items()}
    assert kinds[ids["ok-before"]] == ["ok"] and kinds[ids["ok-after"]] == ["ok"]
    assert kinds["unsigned"] == ["rdq.admin.Unsigned"]
    assert kinds["bad-sig"] == ["rdq.admin.BadSignature"]
    assert kinds["unknown-key"] == ["rdq.admin.UnknownKey"]
    assert kinds["stale"] == ["rdq.admin.Stale"]
    assert kinds["replayed"] == ["ok", "rdq.admin.Replayed"]
    assert kinds[None] == ["rdq.admin.Malformed"]
    assert kinds["unknown-command"] == ["rdq.admin.UnknownCommand"]
    assert kinds["bad-args"] == ["rdq.admin.InvalidArgs"]
    assert kinds["old-key"] == ["ok"]
    for rs in by_id.values():
        for r in rs:
            assert r["instance"] == "test-bridge" and (r["ok"] or r["error"]["message"])
    # A refusal names the request it refuses as verified only when the record was signed with a configured key.
    verified = {rid: [r["verified"] for r in rs] for rid, rs in by_id.items()}
    assert verified["unsigned"] == verified["bad-sig"] == verified["unknown-key"] == [False]
    assert verified[None] == [True]  # not JSON, but signed with a configured key
    assert verified["stale"] == verified["bad-args"] == verified["unknown-command"] == [True]
    assert verified["replayed"] == [True, True] and verified[ids["ok-before"]] == [True]


async def test_forged_refusals_are_not_taken_for_answers_to_a_genuine_request(kafka: KafkaEnv, tmp_path: Path,
                                                                             unique: str) -> None:
    """Anyone who can produce to the admin topic could add refusals to a genuine request's answers (keyed by the
    request_id they saw) and make `rdq` exit non-zero. The CLI now takes only verified answers, one per instance."""
    registry, _ = switch_registry()
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"]}},
                          kafka={"topic_partitions": 1})
    raw = RawAdmin(config)
    request_id = f"genuine-{unique}"

    def forge() -> None:
        time.sleep(0.5)  # after the CLI began listening
        _, value, _ = encode_command("stats", {}, "mallory", "none", request_id=request_id)
        raw.send(value)  # unsigned
        raw.send(value, [("rdq.key_id", b"k1"), ("rdq.signature", sign("guess", value).encode())])

    def run() -> Any:
        session = AdminSession(config, issued_by="sre@test")
        try:
            # instances=2 (one bridge runs): the session reads until the timeout, so the forgeries arrive too
            # (without it, it ends with the one member's answer).
            return session.request("stats", {}, timeout=6.0, request_id=request_id, instances=2)
        finally:
            session.close()

    async with running_bridge(config, registry):
        forger = asyncio.create_task(asyncio.to_thread(forge))
        replies = await asyncio.to_thread(run)
        await forger
    assert [(r["instance"], r["ok"]) for r in replies.final] == [("test-bridge", True)]
    assert sorted(r["error"]["type"] for r in replies.ignored) == ["rdq.admin.BadSignature", "rdq.admin.Unsigned"]


def test_one_answer_per_instance_a_replayed_refusal_after_the_answer_is_not_an_answer() -> None:
    from bridge.admin.client import Replies

    replies = Replies("r")
    ok = {"instance": "a", "ok": True, "verified": True, "result": {}}
    replayed = {"instance": "a", "ok": False, "verified": True, "error": {"type": "rdq.admin.Replayed"}}
    for body in (replayed, ok):  # either order: the command ran once on `a`
        replies.add_final(body, trust_unverified=False)
    assert replies.final == [ok] and replies.ignored == [replayed]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(garbage=st.lists(st.tuples(st.binary(max_size=300), st.lists(st.tuples(
    st.sampled_from(["rdq.key_id", "rdq.signature", "x"]), st.binary(max_size=80)), max_size=3)), min_size=1,
    max_size=8))
def test_garbage_never_stops_the_admin_loop(garbage: list[tuple[bytes, list[tuple[str, bytes]]]],
                                            garbage_admin: Any) -> None:
    """Hypothesis-generated records straight into the loop's handler: each gets a refusal, none raises, and a
    valid command after them still runs."""
    loop, admin, sent = garbage_admin
    for value, headers in garbage:
        loop.run_until_complete(admin.handle(value, headers))
    _, value, headers = encode_command("stats", {}, "x", admin.admin.auth)
    before = admin.handled
    loop.run_until_complete(admin.handle(value, headers))
    assert admin.handled == before + 1
    assert all(not json.loads(v)["ok"] for v in sent[-(len(garbage) + 1):-1])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)
ARG_NAMES = ["task_id", "queue", "dlq", "error_type", "dead_since", "dead_until", "limit", "dry_run", "instance",
             "status", "before", "policy", "topic", "partition", "offset"]
SIGNED_ARGS = st.dictionaries(st.sampled_from(ARG_NAMES) | st.text(max_size=8), JSON, max_size=5) | JSON


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(command=st.sampled_from(["redrive", "get", "list", "purge", "pause", "resume", "set-policy", "stats"])
       | st.text(max_size=20), args=SIGNED_ARGS, extra=st.dictionaries(st.text(max_size=8), JSON, max_size=2),
       drop=st.sampled_from([None, "request_id", "command", "issued_at", "args"]), deep=st.booleans())
def test_correctly_signed_garbage_is_refused_clearly_and_the_loop_serves_on(
        command: str, args: Any, extra: dict[str, Any], drop: str | None, deep: bool, garbage_admin: Any) -> None:
    """Signed with a configured key, so past the signature: command validation itself is fuzzed (wrong types,
    missing and extra fields, huge limits, unknown commands, deep nesting). Each record gets a final answer — ok,
    or a verified refusal with a reason, never `Internal` — and a valid command after it still runs."""
    loop, admin, sent = garbage_admin
    body: dict[str, Any] = {"request_id": uuid.uuid4().hex, "command": command, "args": args,
                            "issued_at": __import__("bridge.admin.protocol").admin.protocol.now_rfc3339(),
                            "issued_by": "fuzz", **{k: v for k, v in extra.items() if k not in ("request_id",)}}
    if drop is not None:
        body.pop(drop, None)
    value = json.dumps(body).encode()
    if deep:
        value = value[:-1] + b', "deep": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    key = KEYS["k1"].encode()
    headers = [("rdq.key_id", b"k1"), ("rdq.signature", sign(key, value).encode())]
    before = len(sent)
    loop.run_until_complete(admin.handle(value, headers))
    finals = [json.loads(v) for v in sent[before:] if not json.loads(v).get("partial")]
    assert len(finals) == 1
    answer = finals[0]
    assert answer["verified"] is True
    if not answer["ok"]:
        assert answer["error"]["type"] != "rdq.admin.Internal", answer
        assert answer["error"]["message"]
    _, value, headers = encode_command("stats", {}, "x", admin.admin.auth)
    loop.run_until_complete(admin.handle(value, headers))
    assert json.loads(sent[-1])["ok"]


def test_replay_protection_holds_across_a_restart(tmp_path: Path) -> None:
    """The same signed bytes after the bridge restarted on the same store: refused as Replayed, not run again."""
    from bridge.admin.commands import AdminCommands
    from bridge.admin.loop import AdminLoop
    from bridge.engine.core import Engine
    from bridge.live_config import LiveConfig
    from bridge.store.tasks import Store
    from tests.helpers import engine_config

    config = engine_config(str(tmp_path / "rdq.db")).model_copy(update={"admin": admin_config_model()})
    _, value, headers = encode_command("pause", {"queue": "q"}, "sre", config.admin.auth)  # type: ignore[union-attr]
    answers = []
    for _ in range(2):  # two lives of the bridge
        loop = asyncio.new_event_loop()
        store = loop.run_until_complete(Store.open(config.store.path))
        engine = Engine(store, LiveConfig(config), Registry(), instance_id="r")
        admin = AdminLoop(config.admin, AdminCommands(engine, lambda t, p, o: None), "r",  # type: ignore[arg-type]
                          lambda: None, lambda: None, engine.clock.now_ms)  # type: ignore[arg-type,return-value]
        sent: list[Any] = []

        async def capture(request_id: Any, result: Any = None, error: Any = None, partial: bool = False,
                          out: list[Any] = sent) -> None:
            out.append((result, error.type if error else None))

        admin._send = capture  # type: ignore[method-assign]
        loop.run_until_complete(admin.handle(value, headers))
        answers.append(sent[-1])
        engine.close()
        loop.run_until_complete(store.close())
        loop.close()
    assert answers[0] == ({"queue": "q", "paused": True}, None)
    assert answers[1] == (None, "rdq.admin.Replayed")


@pytest.fixture(scope="module")
def garbage_admin(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An AdminLoop with a real store; replies captured instead of produced (the loop's logic, not Kafka)."""
    from bridge.admin.commands import AdminCommands
    from bridge.admin.loop import AdminLoop
    from bridge.engine.core import Engine
    from bridge.live_config import LiveConfig
    from bridge.store.tasks import Store
    from tests.helpers import engine_config

    tmp = tmp_path_factory.mktemp("garbage")
    loop = asyncio.new_event_loop()
    config = engine_config(str(tmp / "rdq.db"))
    config = config.model_copy(update={"admin": admin_config_model()})
    store = loop.run_until_complete(Store.open(config.store.path))
    engine = Engine(store, LiveConfig(config), Registry(), instance_id="g")
    admin = AdminLoop(config.admin, AdminCommands(engine, lambda t, p, o: None), "g",  # type: ignore[arg-type]
                      lambda: None, lambda: None, engine.clock.now_ms)  # type: ignore[arg-type,return-value]
    sent: list[bytes] = []

    async def capture(request_id: Any, result: Any = None, error: Any = None, partial: bool = False) -> None:
        from bridge.admin.protocol import reply
        sent.append(reply(request_id, "g", result, error, partial, error.verified if error else True))

    admin._send = capture  # type: ignore[method-assign]
    yield loop, admin, sent
    engine.close()
    loop.run_until_complete(store.close())
    loop.close()


def admin_config_model() -> Any:
    from bridge.config import AdminConfig

    return AdminConfig.model_validate({"topic": "a", "reply_topic": "r", "auth": {"keys": KEYS}})


async def test_rdq_store_reads_a_store_file_without_kafka(tmp_path: Path) -> None:
    from bridge.model import ErrorInfo
    from bridge.store.tasks import Store
    from tests.helpers import failure

    store = await Store.open(tmp_path / "rdq.db")
    dead = failure(dead=ErrorInfo("rdq.Unroutable", "no handler"))
    await store.submit(dead)
    await store.submit(failure())
    out = {}
    for args in (["stats"], ["list", "--status", "DEAD"], ["get", dead.id]):
        proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "bridge.cli", "store", args[0],
                                                        "--db", str(tmp_path / "rdq.db"), *args[1:]],
                                       capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 0, proc.stderr
        out[args[0]] = proc.stdout
    await store.close()
    assert "PENDING" in out["stats"] and "q" in out["stats"]
    assert dead.id in out["list"] and "rdq.Unroutable" in out["list"]
    assert f"task {dead.id}" in out["get"] and "RETRYABLE_FAILURE" not in out["get"]
    assert "PERMANENT_FAILURE" in out["get"]


async def test_a_reply_partition_whose_end_cannot_be_read_is_one_clear_error(kafka: KafkaEnv, tmp_path: Path,
                                                                              unique: str) -> None:
    """A CLI command during a broker's restart (nemesis, CI): the reply partition's end could not be read within its
    retries and `rdq redrive` ended in a KafkaException's traceback, exit 1. Now an AdminClientError naming the topic
    and partition (the CLI prints it as one line, exit 4)."""
    config = admin_config(kafka, tmp_path, unique, {"q": {"handler": "ok", "sources": [f"in-{unique}"]}})
    ensure_topics(config)
    assert config.admin is not None
    session = AdminSession(config, issued_by="sre@test")
    try:
        with pytest.raises(AdminClientError, match=rf"reply topic 'replies-{unique}' partition 99: its end could not "
                                                   r"be read within 1 s: .*Unknown partition"):
            await asyncio.to_thread(session._end_of, TopicPartition(config.admin.reply_topic, 99), 1.0)
    finally:
        session.close()


def test_a_kafka_error_no_command_words_is_one_line_and_exit_4(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Any other KafkaException escaping a command reads as one line, as the admin client's errors do: no
    traceback for an SRE at 3 a.m."""
    import bridge.cli.parser as parser

    def fails(args: Any) -> int:
        raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION, "Failed to get watermark offsets"))

    monkeypatch.setattr(parser, "cmd_store", fails)
    assert cli_main(["store", "stats", "--db", "nowhere.db"]) == 4
    err = capsys.readouterr().err
    assert err == "rdq: kafka: Failed to get watermark offsets\n"


async def test_commands_sent_while_an_instance_was_down_run_there_in_the_order_they_were_sent(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """An instance that starts reads back the last window of every partition of the admin topic. Kafka keeps order
    within a partition only: keyed apart, a `resume` sent after its `pause` could run first there, and the queue
    stayed paused; a set-policy could be undone by the one before it. rdq keys every command alike."""
    registry, _ = switch_registry()
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"]}})
    await asyncio.to_thread(ensure_topics, config)
    sent: list[tuple[str, dict[str, Any]]] = []
    for n in range(1, 9):
        sent += [("pause" if n % 2 else "resume", {"queue": "q"}),
                 ("set-policy", {"queue": "q", "policy": {"max_attempts": n}})]

    def send_all() -> None:
        session = AdminSession(config, issued_by="sre@test")
        try:
            for command, args in sent:  # no instance runs yet: nobody answers
                session.request(command, args, timeout=0, instances=0)
        finally:
            session.close()

    await asyncio.to_thread(send_all)
    records = read_topic(kafka.bootstrap_servers, config.admin.topic, expect=len(sent))
    assert len({(m.key(), m.partition()) for m in records}) == 1  # one partition: read in the order sent
    async with running_bridge(config, registry) as bridge:
        assert bridge.admin is not None
        admin = bridge.admin
        await wait_until(lambda: admin.handled >= len(sent), within=60, what="every command run")
        assert "q" not in bridge.engine.scheduler.paused  # the last of them: resume
        assert (await bridge.store.queue_settings())["q"] == ({"max_attempts": 8}, False)


async def test_a_starting_instance_runs_the_commands_read_back_in_the_order_they_were_produced(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """kcat with keys of its own: a `pause` on one partition, its `resume` a moment later on another, both while the
    instance was down. Read back at its start, they run in the order produced (a merge by timestamp), not in the
    order the partitions are fetched in (the queue stayed paused)."""
    registry, _ = switch_registry()
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"]}})
    await asyncio.to_thread(ensure_topics, config)
    auth = config.admin.auth  # type: ignore[union-attr]
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for partition, command in [(0, "pause"), (2, "pause"), (1, "resume")]:  # the last neither first nor last read
        _, value, headers = encode_command(command, {"queue": "q"}, "kcat@test", auth)
        producer.produce(f"admin-{unique}", value=value, key=command.encode(), partition=partition,
                         headers=headers)  # type: ignore[arg-type]
        assert producer.flush(15) == 0
        await asyncio.sleep(0.05)  # a later timestamp
    async with running_bridge(config, registry) as bridge:
        assert bridge.admin is not None
        admin = bridge.admin
        await wait_until(lambda: admin.handled >= 3, within=60, what="every command run")
        assert "q" not in bridge.engine.scheduler.paused
