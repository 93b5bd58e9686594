"""Changelog benchmarks (SPEC §10): how fast a partition's tasks are restored, and what the changelog adds to the
failure path.

    python -m bench.bench_changelog restore [--n 100000] [--partitions 1]   # tasks with 5 attempts each
    python -m bench.bench_changelog restore --n 1000000 --partitions 12    # all restored at once, one store
    python -m bench.bench_changelog apply [--n 300000]     # the store's apply alone (no Kafka), 12 partitions
    python -m bench.bench_changelog decode [--n 20000]     # a record's decode alone (no Kafka, no store)
    python -m bench.bench_changelog overhead [--n 20000]   # bench_kafka's failure path, changelog off vs on
    python -m bench.bench_changelog ready [--n 5]          # a restart's time to ready: 24 partitions, n tasks each

Each appends its figures to bench/RESULTS.md. Uses KAFKA_BOOTSTRAP_SERVERS, else starts the local broker (not
`apply` and `decode`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, Producer, TopicPartition

from bench.bench_kafka import PAYLOAD, bench_config, broker, produce, regrouped, run_bridge_until
from bench.common import NO_BREAKER, NO_BREAKER_NOTE, record, rss_mib
from bridge.changelog.codec import decode, encode
from bridge.changelog.local import HomeState, LocalIndex
from bridge.changelog.picking import pick_last
from bridge.changelog.restore import Restorer
from bridge.config import BridgeConfig
from bridge.handler_api import HandlerContext
from bridge.kafka_clients import ensure_topics, make_restore_consumer
from bridge.memory import tune_gc
from bridge.registry import Registry
from bridge.service import Bridge
from bridge.store.tasks import Store

STACK = "Traceback (most recent call last):\n  File \"app.py\", line 12, in handle\nConnectionError: refused\n"


class _Clock:
    def now_ms(self) -> int:
        return int(time.time() * 1000)


def task_record(i: int, topic: str, attempts: int, partition: int = 0, now: int | None = None) -> tuple[bytes, bytes]:
    now = (now or 1_790_000_000_000) + i
    task_id = f"01J{i:023d}"
    row: dict[str, Any] = {
        "id": task_id, "queue": "q", "handler_ref": "ok", "handler_version": None, "payload": PAYLOAD[:200],
        "payload_content_type": "application/json", "status": "PENDING", "attempt_count": attempts,
        "redrive_count": 0, "next_attempt_at": now + 3_600_000, "lease_expires_at": None, "lease_token": attempts,
        "lease_owner": None, "lease_started_at": None, "created_at": now, "life_started_at": now,
        "finished_at": None, "fetched_at": None, "dead_reason_type": None, "dead_reason_message": None,
        "dlq_state": None, "dlq_topic": None, "dlq_partition": None, "dlq_offset": None, "home_topic": topic,
        "home_partition": partition, "order_key": None, "order_seq": None, "order_hold": 0,
        "headers": json.dumps({"rdq.source": f"kafka://{topic}/{partition}/{i}", "rdq.kafka.timestamp": str(now),
                               "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}),
    }  # fmt: skip
    history = [{"seq": k, "attempt_no": k, "redrive_no": 0, "started_at": now + k, "finished_at": now + k + 5,
                "outcome": "RETRYABLE_FAILURE", "error_type": "ConnectionError", "error_message": "refused",
                "error_stack": STACK, "worker": "bench", "late_result_of": None, "note": None}
               for k in range(1, attempts + 1)]
    return task_id.encode(), encode(row, history, [], 2 * attempts + 1)


def fill_changelog(bootstrap: str, topic: str, changelog: str, n: int, attempts: int, partitions: int = 1,
                   now: int | None = None) -> int:
    """n tasks' records; `now`: their creation, their next attempt an hour after it (default: long past, due)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1_000_000,
                         "compression.type": "lz4"})
    size = 0
    for i in range(n):
        key, value = task_record(i, topic, attempts, i % partitions, now)
        size += len(value)
        while True:
            try:
                producer.produce(changelog, key=key, value=value, partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(300) == 0
    return size // n


def bare_read(bootstrap: str, changelog: str, n: int, partitions: int = 1) -> float:
    """Baseline: a plain read_committed consumer reading the same records (no decoding, no store)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-bare", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "fetch.max.bytes": 64 * 1024 * 1024,
                         "max.partition.fetch.bytes": 16 * 1024 * 1024})
    consumer.assign([TopicPartition(changelog, p, 0) for p in range(partitions)])
    began, seen = time.perf_counter(), 0
    while seen < n:
        seen += sum(1 for m in consumer.consume(5000, 1.0) if m.error() is None)
    elapsed = time.perf_counter() - began
    consumer.close()
    return n / elapsed


def in_a_child(fn: Callable[..., Any], *args: Any) -> Any:
    with ProcessPoolExecutor(1, multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


async def peak_rss(children_cpu: dict[str, float]) -> tuple[float, float]:
    """Sampled until cancelled: the peak RSS of this process, and of its children (the decoding process); the
    children's CPU seconds as last seen, by pid, into `children_cpu` (a child's last 0.2 s may be missed)."""
    own = children = 0.0
    try:
        while True:
            own = max(own, rss_mib())
            pids = _children()
            children = max(children, sum(rss_mib(pid) for pid in pids))
            for pid in pids:
                children_cpu[pid] = max(children_cpu.get(pid, 0.0), _cpu_seconds(pid))
            await asyncio.sleep(0.2)
    except asyncio.CancelledError:
        return own, children


def _cpu_seconds(pid: str) -> float:
    """User + system CPU of a process so far (/proc/PID/stat, fields 14 and 15, in clock ticks)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children() -> list[str]:
    """This process's spawned Python children (the decoding process) but multiprocessing's resource tracker (a spawn
    context starts one). Not the broker: a bench that starts its own broker is its parent (its JVM's ~430 MiB were
    once printed as the decoding process's)."""
    pids: list[str] = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids += (task / "children").read_text().split()
    return [pid for pid in pids if b"spawn_main" in (cmdline := _cmdline(pid)) and b"resource_tracker" not in cmdline]


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""  # gone: not counted


async def bench_restore(bootstrap: str, n: int, attempts: int = 5, partitions: int = 1) -> None:
    """`partitions` > 1: the tasks spread over that many partitions, all restored at once by one restorer (one
    consumer, one store), as a bridge assigned them all restores them."""
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config = bench_config(bootstrap, Path(tmp), {"handler": "ok"},
                              kafka={"bootstrap_servers": bootstrap, "group_id": f"bench-{Path(tmp).name}",
                                     "topic_partitions": partitions})
        topic = config.queues["q"].sources[0]
        ensure_topics(config)
        changelog = config.changelog_topic(topic)
        # Filled and read by another process: a producer's buffers would stay in this one's RSS.
        size = in_a_child(fill_changelog, bootstrap, topic, changelog, n, attempts, partitions)
        bare = in_a_child(bare_read, bootstrap, changelog, n, partitions)
        store = await Store.open(config.store.path, scoped=True)
        local = LocalIndex(store)
        await local.set_changelogged([topic])
        restorer = Restorer(local, {topic: changelog}, lambda: make_restore_consumer(config, "bench"), _Clock(),
                            lambda: make_restore_consumer(config, "bench", committed_only=False),
                            probe_factory=lambda: make_restore_consumer(config, "bench", probe=True))
        before = rss_mib()
        began = time.perf_counter()
        ready: dict[int, float] = {}

        async def restored(report: Any) -> None:
            await local.set_home(report.home, HomeState.ACTIVE)
            ready[report.home[1]] = time.perf_counter() - began
            reports.append(report)

        reports: list[Any] = []
        children_cpu: dict[str, float] = {}
        peak = asyncio.ensure_future(peak_rss(children_cpu))
        cpu_before = os.times()
        failed = await restorer.restore_many([(topic, p) for p in range(partitions)], lambda _: True, restored)
        spent, in_process = dict(restorer.seconds), restorer.decoded_in_process
        elapsed, rss, cpu_after = time.perf_counter() - began, rss_mib(), os.times()
        peak.cancel()
        own, children = await peak
        tasks = await store.db.read(lambda c: c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])
        rows = await store.db.read(lambda c: c.execute("SELECT COUNT(*) FROM attempt_history").fetchone()[0])
        await store.close()  # the last connection: its WAL checkpointed into the file and removed
        db = Path(config.store.path)
        on_disk = sum(path.stat().st_size for path in db.parent.glob(db.name + "*"))
    own_cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    restored_tasks = sum(r.tasks for r in reports)
    assert not failed and tasks == n and rows == n * attempts and restored_tasks == n, (failed, tasks, rows)
    where = "one partition's" if partitions == 1 else f"{partitions} partitions'"
    record(f"changelog restore: {where} tasks from their changelog into a fresh store", [
        f"tasks: {n}{f' over {partitions} partitions' if partitions > 1 else ''}, {attempts} attempts each, "
        f"~{size / 1024:.1f} KB per changelog record",
        f"baseline: plain read_committed consumer of the same records: {bare:9.0f} records/s",
        f"restore (read, decode, insert into SQLite, synchronous=FULL): {n / elapsed:9.0f} tasks/s  "
        f"ratio {n / elapsed / bare:.2f}  (goal >= {20000 if partitions == 1 else 50000} tasks/s)",
        f"partition unavailable while restoring: {elapsed:.2f} s"
        + (f" (the last; the first ready after {min(ready.values()):.2f} s)" if partitions > 1 else ""),
        f"RSS of the restoring process: {before:.1f} MiB before, peak {own:.1f} MiB, at the end {rss:.1f} MiB; "
        f"the decoding process's peak {children:.1f} MiB",
        f"the store file after the restore: {on_disk / 2**20:.1f} MiB, {on_disk / n:.0f} bytes a task",
        "where the restore's time went (pipelined: the next two batches read and decoded while the store applies this "
        f"one): read {spent['fetch']:.2f} s, decode {spent['decode']:.2f} s "
        f"({f'{in_process} batches in a process of its own' if in_process else 'on the restore thread'}), store apply "
        f"{spent['apply']:.2f} s, waiting for a batch the apply did not hide {spent['waited']:.2f} s",
        # On a machine whose cores are all busy the rate is the CPU a task costs: this compares across runs whose
        # contention differs.
        f"CPU a task: the restoring process {own_cpu / n * 1e6:.1f} us, the decoding process "
        f"{sum(children_cpu.values()) / n * 1e6:.1f} us ({os.cpu_count()} cores)",
    ])


async def bench_apply(n: int, partitions: int = 12, attempts: int = 5) -> None:
    """The restore's apply alone, no Kafka and no other work beside it: batches of 1,000 records a partition, decoded
    first (`pick_last`, not timed), applied as the restorer applies a fetch (its partitions' batches in one group
    commit). What the store's thread costs a task, apart from the contention of a whole restore."""
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        store = await Store.open(Path(tmp) / "rdq.db", scoped=True)
        local = LocalIndex(store)
        await local.set_changelogged(["t"])
        for p in range(partitions):
            await local.restore_begin(("t", p))
        per, wall, cpu = n // partitions, 0.0, 0.0
        sample = [task_record(i, "t", attempts)[1] for i in range(100)]
        for start in range(0, per, 1000):
            picked = [pick_last([(i, *task_record(p * per + i, "t", attempts, partition=p))
                                 for i in range(start, min(start + 1000, per))]) for p in range(partitions)]
            began, times = time.perf_counter(), os.times()
            await asyncio.gather(*(local.restore_batch(("t", p), "cl", batch, 0, []) for p, batch in enumerate(picked)))
            after = os.times()
            wall += time.perf_counter() - began
            cpu += (after.user - times.user) + (after.system - times.system)
        await store.close()
    text = statistics.mean(len(json.dumps(json.loads(value)["attempts"], separators=(",", ":"))) for value in sample)
    stored = statistics.mean(len(h) for value in sample if (h := decode(None, value).history) is not None)
    tasks = per * partitions
    record("changelog restore: the store's apply alone, no Kafka", [
        f"tasks: {tasks} over {partitions} partitions, {attempts} attempts each; batches of 1,000 a partition",
        f"apply: {tasks / wall:9.0f} tasks/s, {wall / tasks * 1e6:.1f} us a task; "
        f"CPU {cpu / tasks * 1e6:.1f} us a task",
        f"a history: {text:.0f} bytes as JSON text, {stored:.0f} bytes as the store keeps it",
    ])


def bench_decode(n: int, attempts: int = 5) -> None:
    """A changelog record's decode alone, on one thread: `codec.decode` (parse, check, the task's row, the history
    packed), and what the decoding process does to a batch (`pick_last`, then pickled to be sent back), against
    parsing the same bytes into Python objects and nothing else (`orjson.loads`). CPU time, best of three."""
    records = [(i, *task_record(i, "t", attempts)) for i in range(n)]

    def best(step: Callable[[], object]) -> float:
        spent = []
        for _ in range(3):
            began = time.process_time()
            step()
            spent.append(time.process_time() - began)
        return min(spent) / n * 1e6

    parse = best(lambda: [orjson.loads(value) for _, _, value in records])
    decoded = best(lambda: [decode(key, value) for _, key, value in records])
    picked = best(lambda: pickle.dumps(pick_last(records, 0, False)))
    record("changelog restore: a record's decode alone, no Kafka, no store", [
        f"records: {n}, {attempts} attempts each, ~{statistics.mean(len(v) for _, _, v in records[:100]) / 1000:.1f} "
        "KB a record",
        f"baseline: orjson.loads alone (parse, no checks):  {parse:6.2f} us a record",
        f"decode (parse, check, row, history packed):     {decoded:6.2f} us a record  ratio {decoded / parse:.2f} of "
        "the parse",
        f"a batch as the decoding process does it (pick_last, pickled to be sent back): {picked:6.2f} us a record",
    ])


async def failure_run(config: BridgeConfig, n: int) -> tuple[float, Bridge]:
    registry = Registry()

    def always_fails(ctx: HandlerContext) -> None:
        raise ConnectionError("downstream is down")

    registry.register("fails", always_fails)

    async def all_stored(bridge: Bridge) -> bool:
        created = bridge.telemetry.metrics.tasks_created.labels("q", "PENDING")._value.get()
        if created < n:
            return False
        # Done = durable as the configuration defines it: with the changelog, in the changelog.
        return bridge.changelog is None or not await bridge.changelog.local.outbox(1)

    return await run_bridge_until(config, all_stored, registry)


async def bench_overhead(bootstrap: str, n: int) -> None:
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        base = bench_config(bootstrap, Path(tmp), {"handler": "fails", "max_attempts": 5,
                                                   "backoff": {"kind": "fixed", "base": "1h"}, **NO_BREAKER})
        topic = base.queues["q"].sources[0]
        ensure_topics(base)
        produce(bootstrap, topic, n)
        off = regrouped(base, "off")
        off = off.model_copy(update={"store": off.store.model_copy(update={"changelog": False})})
        on = regrouped(base, "on")
        ensure_topics(on)
        off_elapsed, _ = await failure_run(off, n)
        on_elapsed, bridge = await failure_run(on, n)
        stats = bridge.changelog.writer.stats if bridge.changelog else {}
    off_rate, on_rate = n / off_elapsed, n / on_elapsed
    record("changelog overhead on the failure path (every first attempt fails and is stored)", [
        f"records: {n} x 1 KB through Kafka, each a PENDING task with its first attempt; one run, both settings",
        NO_BREAKER_NOTE,
        f"changelog off (SQLite only): {off_rate:9.0f} records/s",
        f"changelog on (SQLite + changelog transaction + offsets in it): {on_rate:9.0f} records/s  "
        f"cost +{(off_rate / on_rate - 1) * 100:.0f}% time  (goal <= +25%; transactions {stats.get('transactions')})",
    ])


READY_PARTITIONS = 24


def join_time(config: BridgeConfig, topic: str) -> float:
    """Baseline: a plain consumer of the same group settings joining a fresh group of the source topic, until its
    partitions are assigned (what any consumer pays before its first record)."""
    assigned = []
    consumer = Consumer({"bootstrap.servers": config.kafka.bootstrap_servers, "group.id": f"{config.kafka.group_id}-"
                         "bare", "partition.assignment.strategy": "cooperative-sticky"})
    began = time.perf_counter()
    consumer.subscribe([topic], on_assign=lambda c, ps: assigned.extend(ps))
    while len(assigned) < READY_PARTITIONS:
        consumer.poll(0.02)
    elapsed = time.perf_counter() - began
    consumer.close()
    return elapsed


async def ready_run(bootstrap: str, per_partition: int) -> tuple[float, float]:
    """One run: (the bare consumer's join, the bridge's start → every partition owned), in seconds."""
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config = bench_config(bootstrap, Path(tmp), {"handler": "ok"},
                              kafka={"bootstrap_servers": bootstrap, "topic_partitions": READY_PARTITIONS,
                                     "group_id": f"bench-ready-{Path(tmp).name}"})
        topic = config.queues["q"].sources[0]
        ensure_topics(config)
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        for p in range(READY_PARTITIONS):
            for i in range(per_partition):
                key, value = task_record(p * per_partition + i, topic, 5, partition=p, now=int(time.time() * 1000))
                producer.produce(config.changelog_topic(topic), key=key, value=value, partition=p)
        assert producer.flush(60) == 0
        bare = join_time(config, topic)
        pending: list[int] = []

        async def ready(bridge: Bridge) -> bool:  # every partition assigned and restored: it runs them all
            if not all(bridge.consumer.owns(topic, p) for p in range(READY_PARTITIONS)):
                return False
            pending.append((await bridge.store.counts()).get("q", {}).get("PENDING", 0))
            return True

        elapsed, _ = await run_bridge_until(config, ready, within=300)
    assert pending == [READY_PARTITIONS * per_partition], f"not every task restored: {pending}"
    return bare, elapsed


async def bench_ready(bootstrap: str, per_partition: int, runs: int = 3) -> None:
    """A restart onto a fresh store: the changelog holds `per_partition` open tasks of each of 24 partitions; the
    time from the bridge's start until it owns every partition (all restored), against a bare consumer's join."""
    bare_s, bridge_s = zip(*[await ready_run(bootstrap, per_partition) for _ in range(runs)], strict=True)
    record("time to ready after a restart onto a fresh store (changelog restore of every partition)", [
        f"{READY_PARTITIONS} partitions x {per_partition} open tasks (5 attempts each) in the changelog; {runs} runs, "
        "production defaults",
        "baseline: a bare consumer joining a fresh group of the same topic until assigned: "
        + "/".join(f"{s:.2f}" for s in bare_s) + " s",
        "bridge: start → every partition owned (joined, all restored): " + "/".join(f"{s:.2f}" for s in bridge_s)
        + f" s  (goal < 2 s; medians: bridge {statistics.median(bridge_s):.2f} s, bare join "
        f"{statistics.median(bare_s):.2f} s)",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["restore", "apply", "decode", "overhead", "ready", "all"])
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--partitions", type=int, default=1, help="restore: the tasks spread over this many")
    args = parser.parse_args()
    tune_gc()  # the bridges run in this process: set up as `rdq run` sets up its own (production defaults)
    if args.which in ("decode", "all"):  # no broker needed
        bench_decode(args.n or 20_000)
    if args.which in ("apply", "all"):
        asyncio.run(bench_apply(args.n or 300_000))
    if args.which in ("apply", "decode"):
        return
    with broker() as bootstrap:
        if args.which == "restore":
            asyncio.run(bench_restore(bootstrap, args.n or 100_000, partitions=args.partitions))
        if args.which == "all":  # both restore rows of the goals: 100k tasks on one partition, 1M over 12
            asyncio.run(bench_restore(bootstrap, args.n or 100_000))
            asyncio.run(bench_restore(bootstrap, args.n or 1_000_000, partitions=12))
        if args.which in ("overhead", "all"):
            asyncio.run(bench_overhead(bootstrap, args.n or 20_000))
        if args.which in ("ready", "all"):
            asyncio.run(bench_ready(bootstrap, args.n or 5))


if __name__ == "__main__":
    main()
