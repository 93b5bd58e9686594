"""Per-key ordering through a real broker (SPEC §12): a failing record holds back only the later records of its
own key; their offsets are committed once they are parked; a dead head releases its key or holds it until an SRE
skips or redrives it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.handler_api import HandlerContext, Permanent
from bridge.kafka_clients import ensure_topics
from bridge.model import Status
from bridge.registry import Registry
from bridge.store.reader import StoreReader
from tests.conftest import KafkaEnv
from tests.kafka_helpers import (
    BridgeProcess,
    aread_dlq,
    committed_lag,
    example_log,
    kafka_config,
    produce,
    running_bridge,
    wait_until,
)
from tests.test_admin import admin_config, one
from tests.test_observability import scrape

pytestmark = pytest.mark.kafka


class Recorder:
    """A handler that records (key, seq, attempt, when) of each success, and fails as told."""

    def __init__(self, fail: dict[tuple[str, int], int], permanent: set[tuple[str, int]] = frozenset()) -> None:
        self.fail = dict(fail)  # (key, seq) → retryable failures before it succeeds
        self.permanent = set(permanent)
        self.done: list[tuple[str, int, int, float]] = []
        self.running: dict[str, int] = {}
        self.overlaps: list[str] = []
        self.slow: dict[tuple[str, int], float] = {}  # (key, seq) → seconds it takes
        self.lock = threading.Lock()

    def __call__(self, ctx: HandlerContext) -> None:
        body = json.loads(ctx.payload)
        key, seq = body["key"], body["seq"]
        with self.lock:
            if self.running.get(key):
                self.overlaps.append(f"{key}/{seq}")  # two records of one key at once
            self.running[key] = self.running.get(key, 0) + 1
        try:
            time.sleep(self.slow.get((key, seq), 0.0005))
            if (key, seq) in self.permanent:
                raise Permanent(f"{key}/{seq} cannot succeed")
            if self.fail.get((key, seq), 0) >= ctx.attempt:
                raise ConnectionError(f"{key}/{seq} attempt {ctx.attempt}")
            with self.lock:
                self.done.append((key, seq, ctx.attempt, time.monotonic()))
        finally:
            with self.lock:
                self.running[key] -= 1

    def seqs(self, key: str) -> list[int]:
        return [seq for k, seq, _, _ in self.done if k == key]


def records(keys: int, per_key: int) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    """Interleaved: seq n of every key, then seq n + 1 of every key…"""
    return [(f"k{k}".encode(), json.dumps({"key": f"k{k}", "seq": n}).encode(), [])
            for n in range(per_key) for k in range(keys)]


def ordered_config(kafka: KafkaEnv, tmp_path: Path, unique: str, **queue: Any) -> Any:
    base = {"handler": "recorder", "sources": [f"in-{unique}"], "ordering": "key", "max_attempts": 5,
            "backoff": {"kind": "fixed", "base": "3s"}, "breaker": {"enabled": False}, **queue}
    return admin_config(kafka, tmp_path, unique, {"q": base}, kafka={"topic_partitions": 1}, telemetry={"port": 0})


async def test_a_failing_record_holds_back_only_its_own_key_and_the_commit_passes_its_parked_records(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """10 keys x 200 records in one partition; record 50 of key 3 fails twice, then succeeds (3 s backoff)."""
    recorder = Recorder({("k3", 50): 2})
    registry = Registry()
    registry.register("recorder", recorder)
    config = ordered_config(kafka, tmp_path, unique)
    async with running_bridge(config, registry) as bridge:
        began = time.monotonic()
        produce(config, f"in-{unique}", records(10, 200))

        async def parked_and_committed() -> bool:
            counts = (await bridge.store.counts()).get("q", {})
            return counts.get("PARKED", 0) > 0 and committed_lag(config, f"in-{unique}") == 0

        # The commit passes the parked records while key 3 still waits for its retry.
        await wait_until(parked_and_committed, within=60, what="parked records committed past")
        assert [k for k, seq, attempt, _ in recorder.done if k == "k3" and seq >= 50] == []

        await wait_until(lambda: len(recorder.done) == 2000, within=120, what="every record to succeed")

        async def ended() -> bool:  # the handler's last return comes a moment before the store records it
            return (await bridge.store.counts())["q"].get("SUCCEEDED", 0) == 150

        await wait_until(ended, within=30, what="the last success recorded")
        counts = (await bridge.store.counts())["q"]
        # Its tasks all ended, key 3 is free again: its next records run on first delivery, no task made. (The lane
        # learns it from the store within a few 200 ms rounds; a record arriving sooner would be parked and, with
        # nothing open, made due at once: in order, only slower.)
        await asyncio.sleep(1.5)
        produce(config, f"in-{unique}", [(b"k3", json.dumps({"key": "k3", "seq": 200 + n}).encode(), [])
                                         for n in range(10)])
        await wait_until(lambda: len(recorder.done) == 2010, within=60, what="key 3's later records")
        assert (await bridge.store.counts())["q"]["SUCCEEDED"] == 150
    assert counts["PARKED"] == 0 and counts["PENDING"] == 0 and counts["SUCCEEDED"] == 150  # 50..199 of key 3
    for k in range(10):
        assert recorder.seqs(f"k{k}") == list(range(210 if k == 3 else 200)), f"k{k} out of order"
    assert recorder.overlaps == []
    k3_retry = next(when for key, seq, attempt, when in recorder.done if (key, seq) == ("k3", 50))
    others_done = max(when for key, _, _, when in recorder.done if key != "k3")
    assert others_done < k3_retry - 1.0, "other keys were held back by key 3's backoff"
    assert k3_retry - began >= 6.0  # two failures, 3 s apart


async def test_a_dead_head_releases_its_key_or_holds_it_until_skipped_or_redriven(kafka: KafkaEnv,
                                                                                   tmp_path: Path,
                                                                                   unique: str) -> None:
    recorder = Recorder({}, permanent={("k0", 1), ("k1", 1), ("k2", 1)})
    registry = Registry()
    registry.register("recorder", recorder)
    config = ordered_config(kafka, tmp_path, unique, on_dead="hold", dlq_topic=f"dlq-{unique}")
    async with running_bridge(config, registry) as bridge:
        produce(config, f"in-{unique}", records(3, 5))

        async def parked(n: int) -> bool:
            return (await bridge.store.counts()).get("q", {}).get("PARKED", 0) == n

        await wait_until(lambda: len(recorder.done) == 3, what="seq 0 of each key")
        await wait_until(lambda: parked(9), what="seq 2..4 of each key parked behind its dead head")
        assert bridge.health is not None and bridge.health.bound_port
        await asyncio.sleep(2.5)  # one health probe round for the gauges
        metrics = await asyncio.to_thread(scrape, bridge.health.bound_port)
        assert metrics[("rdq_open_tasks", (("queue", "q"), ("status", "PARKED")))] == 9
        assert metrics[("rdq_parked_oldest_seconds", (("queue", "q"),))] >= 0.5  # parked a second or more ago
        dead = {json.loads((await bridge.store.get(t.id)).payload)["key"]: t  # type: ignore[union-attr]
                for t in await bridge.store.list_tasks("q", Status.DEAD)}
        assert sorted(dead) == ["k0", "k1", "k2"]
        view = await one(config, "get", {"task_id": dead["k0"].id})
        assert view["task"]["parked_behind"] == 3 and view["task"]["ordering"]["hold"]
        [waiting] = [t for t in await bridge.store.list_tasks("q", Status.PARKED)
                     if json.loads((await bridge.store.get(t.id)).payload) == {"key": "k0", "seq": 2}]  # type: ignore[union-attr]
        assert (await one(config, "get", {"task_id": waiting.id}))["task"]["waits_behind"]["id"] == dead["k0"].id

        # skip: k0's dead head stays dead, its next records run, in order.
        skipped = await one(config, "skip", {"task_id": dead["k0"].id})
        assert skipped["skipped"] and skipped["parked_behind"] == 2  # seq 2 released, 3 and 4 wait for it
        await wait_until(lambda: recorder.seqs("k0") == [0, 2, 3, 4], what="k0 released in order")
        # redrive: k1's head (fixed now) runs first, then the rest of k1.
        recorder.permanent.discard(("k1", 1))
        assert (await one(config, "redrive", {"task_id": dead["k1"].id}))["count"] == 1
        await wait_until(lambda: recorder.seqs("k1") == [0, 1, 2, 3, 4], what="k1's head first, then the rest")
        assert recorder.seqs("k2") == [0]  # still held
        assert await parked(3)
        # Each dead head's DLQ record says how many records of its key were parked behind it when it was published
        # (a key's records are parked one after the other, each once the one before it is stored).
        envelopes = {r.value["task"]["id"]: r.value for r in await aread_dlq(kafka.bootstrap_servers,
                                                                             f"dlq-{unique}", expect=3)}
        assert all(0 <= envelopes[t.id]["task"]["ordering"]["parked_behind"] <= 3 for t in dead.values())
        assert (await one(config, "get", {"task_id": dead["k2"].id}))["task"]["parked_behind"] == 3
    assert recorder.overlaps == []


async def test_on_dead_release_lets_the_key_go_on_past_its_dead_head(kafka: KafkaEnv, tmp_path: Path,
                                                                     unique: str) -> None:
    recorder = Recorder({}, permanent={("k0", 1)})
    registry = Registry()
    registry.register("recorder", recorder)
    recorder.fail[("none", 0)] = 1  # a record without a key is its own key: its failure holds back nothing
    config = ordered_config(kafka, tmp_path, unique)  # on_dead: release (the default)
    async with running_bridge(config, registry) as bridge:
        produce(config, f"in-{unique}", [*records(2, 5), *((None, json.dumps({"key": "none", "seq": n}).encode(), [])
                                                            for n in range(3))])
        await wait_until(lambda: len(recorder.done) == 12, what="every record but the dead one")
        assert recorder.seqs("k0") == [0, 2, 3, 4] and recorder.seqs("k1") == [0, 1, 2, 3, 4]
        assert recorder.seqs("none") == [1, 2, 0]  # not held back by the keyless record 0's retry (3 s later)
        counts = (await bridge.store.counts())["q"]
        assert counts["DEAD"] == 1 and counts["PARKED"] == 0


async def test_a_redriven_record_runs_before_its_keys_records_that_arrive_while_it_runs(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """A redrive makes a dead record due in the scheduler while its lane runs the key's new records inline: the
    lane must park them behind it (SPEC §12 with §7.3), not run them beside it."""
    recorder = Recorder({}, permanent={("k0", 1)})
    registry = Registry()
    registry.register("recorder", recorder)
    config = ordered_config(kafka, tmp_path, unique)  # on_dead: release
    async with running_bridge(config, registry) as bridge:
        produce(config, f"in-{unique}", records(1, 5))
        await wait_until(lambda: len(recorder.done) == 4, what="every record but the dead one")
        [dead] = await bridge.store.list_tasks("q", Status.DEAD)
        lanes = bridge.consumer.lanes.values()
        await wait_until(lambda: not any(lane.blocked_keys() for lane in lanes), what="k0 free (its head is dead)")
        recorder.permanent.clear()
        recorder.slow[("k0", 1)] = 1.5  # fixed now, and slow: the key's next records arrive while it runs
        assert await bridge.engine.redrive(dead.id)
        produce(config, f"in-{unique}", [(b"k0", json.dumps({"key": "k0", "seq": n}).encode(), []) for n in (5, 6)])
        await wait_until(lambda: len(recorder.done) == 7, what="the redriven record and the two after it")
        assert recorder.overlaps == []
        assert recorder.seqs("k0") == [0, 2, 3, 4, 1, 5, 6]


def test_sigkill_while_records_are_parked_keeps_each_keys_order_and_loses_nothing(kafka: KafkaEnv, tmp_path: Path,
                                                                                    unique: str) -> None:
    """A real `rdq run` (the example `flaky` handler, RDQ_EXAMPLE_LOG), SIGKILLed twice while records of a failing
    key are parked; binary keys (base64 with `/`, the empty key). Over the whole run — across the kills, not only
    between them — each key's first successes come in offset order (a record that ran and was not committed may
    run again, at-least-once); in the end every record succeeded."""
    topic = f"in-{unique}"
    log_path = tmp_path / "example.log"
    config = kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "flaky", "sources": [topic], "ordering": "key", "max_attempts": 8, "lease": "3s",
              "backoff": {"kind": "fixed", "base": "700ms"}, "breaker": {"enabled": False}}},
        kafka={"topic_partitions": 1, "consumer": {"group.instance.id": f"bridge-{unique}",
                                                   "session.timeout.ms": 10000}})
    ensure_topics(config)
    keys, per_key = 5, 60
    # Record n of key k is offset n * keys + k. Key 0 fails a few times at 10, 25 and 40: its later records park.
    fails = {(0, 10): 3, (0, 25): 2, (0, 40): 3}
    key_of = {n * keys + k: k for n in range(per_key) for k in range(keys)}
    produce(config, topic, [(BINARY_KEYS[k], json.dumps({"fail": fails.get((k, n), 0), "ms": 2}).encode(), [])
                            for n in range(per_key) for k in range(keys)])
    bridge = BridgeProcess(config, tmp_path / "bridge.yaml", {"RDQ_EXAMPLE_LOG": str(log_path)})
    segments = []  # the example log's length at each kill
    parked_at_kills = []
    for wait in (2.5, 3.0):
        bridge.start()
        time.sleep(wait)
        assert bridge.alive, bridge.tail()
        bridge.kill()
        segments.append(len(example_log(log_path)))
        parked_at_kills.append(StoreReader(config.store.path).counts().get("q", {}).get("PARKED", 0))
    bridge.start()
    try:
        deadline = time.monotonic() + 120
        while {int(e["source"].rsplit("/", 1)[1]) for e in example_log(log_path)} != set(key_of):
            assert time.monotonic() < deadline, bridge.tail()
            time.sleep(0.2)
    finally:
        assert bridge.terminate() == 0, bridge.tail()
    assert any(parked_at_kills), parked_at_kills  # killed while records were parked
    entries = [int(e["source"].rsplit("/", 1)[1]) for e in example_log(log_path)]
    first = list(dict.fromkeys(entries))  # each record's first success, in the order they happened
    assert len(segments) == 2 and segments[0] <= segments[1] <= len(entries)
    for k in range(keys):
        offsets = [o for o in first if key_of[o] == k]
        assert offsets == sorted(offsets), f"key {BINARY_KEYS[k]!r} out of order across the kills: {offsets}"


BINARY_KEYS = [b"ab?", b"?\xff", b"", b"a/b:c", b"\x00/\xfe\xff:/"]  # base64 YWI/, P/8=, "", YS9iOmM=, AC/+/zov


@pytest.mark.parametrize("changelog", [False, True])
async def test_binary_keys_keep_their_order_across_a_restart(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                                             changelog: bool) -> None:
    """A key is bytes: base64 of a key holds `/` (about 30% of random 16-byte keys). At a restart the lane reads
    the partition's open keys from the store; splitting an ordering key from the right blocked the wrong key
    (YWI/) or raised in the consumer (P/8=: nothing of the partition ran again). With the changelog, the keys
    were read while the partition restored, before its tasks were back: every key's next record ran at once."""
    labels = {key: f"K{i}" for i, key in enumerate(BINARY_KEYS)}
    recorder = Recorder({(label, 0): 10**6 for label in labels.values()})  # seq 0 of every key fails until told
    registry = Registry()
    registry.register("recorder", recorder)
    config = ordered_config(kafka, tmp_path, unique, backoff={"kind": "fixed", "base": "500ms"}, max_attempts=1000)
    config = config.model_copy(update={"store": config.store.model_copy(update={"changelog": changelog})})

    def batch(seq: int) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
        return [(key, json.dumps({"key": label, "seq": seq}).encode(), []) for key, label in labels.items()]

    async with running_bridge(config, registry) as bridge:
        produce(config, f"in-{unique}", batch(0))

        async def pending(n: int) -> bool:
            return (await bridge.store.counts()).get("q", {}).get("PENDING", 0) + \
                (await bridge.store.counts()).get("q", {}).get("IN_FLIGHT", 0) == n

        await wait_until(lambda: pending(len(labels)), what="seq 0 of every key stored as a task")
    async with running_bridge(config, registry) as bridge:
        produce(config, f"in-{unique}", [*batch(1), (b"free", json.dumps({"key": "free", "seq": 0}).encode(), [])])
        await wait_until(lambda: recorder.seqs("free") == [0], what="a key with no open task runs at once")

        async def parked(n: int) -> bool:
            return (await bridge.store.counts()).get("q", {}).get("PARKED", 0) == n

        await wait_until(lambda: parked(len(labels)), what="seq 1 of every key parked behind its open seq 0")
        assert all(recorder.seqs(label) == [] for label in labels.values())
        recorder.fail.clear()
        await wait_until(lambda: all(recorder.seqs(label) == [0, 1] for label in labels.values()), within=60,
                         what="each key's two records, in order")
        assert (await bridge.store.counts())["q"].get("PARKED", 0) == 0
    assert recorder.overlaps == []


async def test_a_hot_keys_records_set_aside_count_towards_the_pause(kafka: KafkaEnv, tmp_path: Path,
                                                                    unique: str) -> None:
    """One key, its first record's handler stuck: every later record of the key is set aside in the lane. They were
    not counted by the pause logic (only the lane's ready queue was), so the partition was never paused and
    memory grew with every fetch. Now the partition pauses past the backlog bound, and all run in order after."""
    release = threading.Event()
    done: list[int] = []

    def hot(ctx: HandlerContext) -> None:
        seq = json.loads(ctx.payload)["seq"]
        if seq == 0:
            release.wait(60)
        done.append(seq)

    registry = Registry()
    registry.register("recorder", hot)
    config = ordered_config(kafka, tmp_path, unique)
    n = 6000  # past the 2,000 fetched records a partition may hold before it pauses
    async with running_bridge(config, registry) as bridge:
        produce(config, f"in-{unique}", [(b"hot", json.dumps({"key": "hot", "seq": i}).encode(), [])
                                         for i in range(n)])
        tp = (f"in-{unique}", 0)
        consumer = bridge.consumer

        def paused_by_its_backlog() -> bool:
            lane = consumer.lanes.get(tp)  # (a partition is paused while it restores, too: not that pause)
            restored = tp not in consumer.restoring
            return lane is not None and restored and lane.set_aside > 2000 and tp in consumer.paused

        await wait_until(paused_by_its_backlog, within=60, what="the partition paused by its set-aside records")
        await asyncio.sleep(1.0)
        lane = consumer.lanes[tp]
        assert tp in consumer.paused and lane.backlog > 2000  # it stays paused while its backlog is high
        release.set()
        await wait_until(lambda: len(done) == n, within=120, what="every record of the hot key")
    assert done == list(range(n))
