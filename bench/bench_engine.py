"""Retry-engine benchmarks (issue 3). Each prints its figures and appends them to bench/RESULTS.md.

    python -m bench.bench_engine failures [--n 20000] [--batch 500]   # durable failure writes vs plain SQLite
    python -m bench.bench_engine retry [--n 20000]                    # claim + complete per second
    python -m bench.bench_engine scale [--sizes 10000,100000,1000000] # claim latency and RSS vs tasks stored
    python -m bench.bench_engine binding [--n 20000]                  # NULLs and blobs bound with / without adapters
    python -m bench.bench_engine lane [--n 20000]                     # a lane's runner vs the handler alone, no Kafka
    python -m bench.bench_engine all
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import percentile, record, rss_mib
from bridge.changelog.picking import TASK_ROW, pick_last
from bridge.clock import SystemClock
from bridge.config import parse_config
from bridge.engine.core import Engine
from bridge.engine.threads import HandlerThreads
from bridge.handler_api import HandlerContext
from bridge.live_config import LiveConfig
from bridge.model import Attempt, ErrorInfo, NewTask, Outcome, Status, new_task_id
from bridge.records import Fetched, SourceRecord
from bridge.registry import Registry
from bridge.source.ends import Results
from bridge.source.first_delivery import FirstDelivery
from bridge.source.lanes import Lane
from bridge.source.offsets import PartitionTracker
from bridge.store.bulk import insert_rows
from bridge.store.history import with_history_functions
from bridge.store.queries import q
from bridge.store.results import RunReport
from bridge.store.tasks import Store

PAYLOAD = b'{"order": 12345, "items": [1, 2, 3], "note": "' + b"x" * 900 + b'"}'  # ~1 KB
_OFFSETS = itertools.count()
STACK = "Traceback (most recent call last):\n" + '  File "app.py", line 10, in handle\n' * 8 + "ConnectionError"


def new_failures(n: int, now: int, due_in_ms: int = 0) -> list[NewTask]:
    error = ErrorInfo("ConnectionError", "connect timed out after 500ms", STACK)
    headers = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "rdq.kafka.key": "b3JkZXItMTIzNDU=",
               "rdq.kafka.timestamp": "1800000000000"}
    return [NewTask("q", "ok", PAYLOAD, {**headers, "rdq.source": f"kafka://orders/3/{next(_OFFSETS)}"},
                    Status.PENDING, now,
                    Attempt(1, 0, now, now, Outcome.RETRYABLE_FAILURE, error, "bench"), now + due_in_ms)
            for _ in range(n)]


# ---- 1. failures stored per second ------------------------------------------------------------------------


def plain_inserts(path: Path, tasks: list[NewTask], batch: int) -> float:
    """Baseline: the same rows, executemany in transactions of `batch`, same WAL + synchronous=FULL; a connection
    opened as the bridge opens its own (the queries read the attempts' views, which need `rdq_history`)."""
    conn = with_history_functions(sqlite3.connect(path, isolation_level=None))
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    began = time.perf_counter()
    for i in range(0, len(tasks), batch):
        chunk = tasks[i : i + batch]
        conn.execute("BEGIN")
        conn.executemany(q("insert_task"), [t.params() for t in chunk])
        conn.executemany(q("insert_attempt"), [t.first_attempt.params(t.id) for t in chunk if t.first_attempt])
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - began
    conn.close()
    return len(tasks) / elapsed


async def store_submits(path: Path, tasks: list[NewTask], batch: int) -> tuple[float, Store]:
    """The store as the consumer drives it: a batch of records fails, all its failures are stored at once."""
    store = await Store.open(path)
    began = time.perf_counter()
    for i in range(0, len(tasks), batch):
        await asyncio.gather(*(store.submit(t) for t in tasks[i : i + batch]))
    elapsed = time.perf_counter() - began
    await store.close()
    return len(tasks) / elapsed, store


async def bench_failures(n: int, batch: int) -> None:
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        now = SystemClock().now_ms()
        base_path, store_path = Path(tmp) / "plain.db", Path(tmp) / "store.db"
        store = await Store.open(base_path)  # the same schema and indexes for the baseline
        await store.close()
        baseline = plain_inserts(base_path, new_failures(n, now), batch)
        rate, used = await store_submits(store_path, new_failures(n, now), batch)
    record("failures stored per second (synchronous=FULL)", [
        f"tasks: {n}, 1 KB payload, 1 attempt each; records failing together: {batch}",
        f"baseline  plain executemany, {batch} rows per transaction: {baseline:10.0f} /s",
        f"rdq store submit(), group commit:                 {rate:10.0f} /s  "
        f"(transactions: {used.stats.batches}, largest: {used.stats.largest_batch})",
        f"ratio store / baseline: {rate / baseline:.2f}  (goal >= 0.5 and >= 5000/s)",
    ])


# ---- 2. claim + complete per second ----------------------------------------------------------------------


async def bench_retry(n: int) -> None:
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        now = SystemClock().now_ms()
        store = await Store.open(Path(tmp) / "a.db")
        for _ in range(0, n, 1000):
            await asyncio.gather(*(store.submit(t) for t in new_failures(1000, now)))
        began = time.perf_counter()
        done = 0

        async def worker() -> None:
            nonlocal done
            while True:
                tasks = await store.claim_due("q", 50, 30.0, "bench", SystemClock().now_ms())
                if not tasks:
                    return
                t = SystemClock().now_ms()
                await asyncio.gather(*(store.record_success(x.id, x.lease_token, x.attempt_count, RunReport(
                    t, t, Outcome.SUCCESS, None, "bench")) for x in tasks))
                done += len(tasks)

        await asyncio.gather(*(worker() for _ in range(4)))
        raw = done / (time.perf_counter() - began)
        await store.close()

        scheduled = await through_scheduler(Path(tmp) / "b.db", n, now)
    record("retry path: due tasks claimed, run and completed per second", [
        f"due tasks: {n}",
        f"store only (claim 50 + record_success, 4 workers): {raw:8.0f} /s",
        f"scheduler with a no-op async handler (concurrency 64): {scheduled:8.0f} /s  (goal >= 3000/s)",
    ])


async def through_scheduler(path: Path, n: int, now: int) -> float:
    store = await Store.open(path)
    for _ in range(0, n, 1000):
        await asyncio.gather(*(store.submit(t) for t in new_failures(1000, now)))
    registry = Registry()

    async def noop(ctx: object) -> None:
        return None

    registry.register("ok", noop)
    config = parse_config({"kafka": {"bootstrap_servers": "x:1"}, "queues": {"q": {"handler": "ok",
                           "concurrency": 64}}, "engine": {"handler_modules": []}})
    engine = Engine(store, LiveConfig(config), registry, instance_id="bench")
    stop = asyncio.Event()
    began = time.perf_counter()
    runner = asyncio.create_task(engine.scheduler.run(stop))
    while (await store.counts())["q"]["SUCCEEDED"] < n:  # noqa: ASYNC110 - polling the store is the measurement
        await asyncio.sleep(0.05)
    rate = n / (time.perf_counter() - began)
    stop.set()
    await runner
    engine.close()
    await store.close()
    return rate


# ---- 3. claim latency and memory with many tasks stored --------------------------------------------------


def fill(path: Path, total: int, due: int, now: int) -> None:
    """Bulk-load `total` tasks: `due` due now, the rest finished or due far in the future."""
    conn = with_history_functions(sqlite3.connect(path, isolation_level=None))
    conn.execute("PRAGMA synchronous=OFF")
    headers = json.dumps({"rdq.source": "kafka://orders/0/1", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    chunk = 50_000
    for start in range(0, total, chunk):
        rows = []
        for i in range(start, min(total, start + chunk)):
            kind = i % 10
            if i < due:
                status, next_at, finished = "PENDING", now - 1, None
            elif kind < 7:
                status, next_at, finished = "SUCCEEDED", None, now
            elif kind < 9:
                status, next_at, finished = "DEAD", None, now
            else:
                status, next_at, finished = "PENDING", now + 86_400_000, None
            rows.append((new_task_id(), "q", "ok", PAYLOAD, "application/json", headers, status, 1, next_at, now,
                         now, finished, "PUBLISHED" if status == "DEAD" else None))
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO tasks (id, queue, handler_ref, payload, payload_content_type, headers, status, attempt_count,"
            " next_attempt_at, created_at, life_started_at, finished_at, dlq_state)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
        conn.execute("COMMIT")
    conn.execute("ANALYZE")
    conn.close()


async def bench_scale(sizes: list[int], claims: int) -> None:
    lines = [f"claim_due(limit=10) latency over {claims} claims; 70% SUCCEEDED, 20% DEAD, 10% future PENDING, "
             f"{claims * 10} due"]
    for size in sizes:
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            path = Path(tmp) / "scale.db"
            store = await Store.open(path)
            await store.close()
            now = SystemClock().now_ms()
            fill(path, size, claims * 10, now)
            store = await Store.open(path)
            try:  # closed whatever happens: its threads would keep a failed bench from exiting
                latencies = []
                for _ in range(claims):
                    began = time.perf_counter()
                    got = await store.claim_due("q", 10, 30.0, "bench", now)
                    latencies.append((time.perf_counter() - began) * 1000)
                    assert len(got) == 10
                params = {"queue": "q", "now": now, "limit": 10, "lease_ms": 1, "owner": "x", "scoped": 0}
                plan = await store.db.read(lambda c, p=params: " / ".join(
                    r[3] for r in c.execute("EXPLAIN QUERY PLAN " + q("claim_due"), p)))
            finally:
                await store.close()
            p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
            lines.append(f"{size:>9} tasks: p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  RSS {rss_mib():6.1f} MiB  "
                         f"file {path.stat().st_size / 2**20:7.1f} MiB")
    lines.append(f"query plan: {plan}")
    lines.append("goal: p99 < 5 ms at 1M, memory flat")
    record("claim latency and memory vs tasks stored", lines)


# ---- 4. binding NULLs and blobs -----------------------------------------------------------------------------


_IDENTITY = [(type(None), sqlite3.PrepareProtocol), (bytes, sqlite3.PrepareProtocol)]


def _adapters(on: bool, saved: dict[Any, Any]) -> None:
    for key in _IDENTITY:
        if on:
            sqlite3.adapters[key] = saved[key]
        else:
            sqlite3.adapters.pop(key, None)


def _bind_rounds(path: Path, rows: list[tuple[Any, ...]], on: bool, saved: dict[Any, Any]) -> float:
    """CPU microseconds a row, this thread's (the binding is CPU under the GIL): the restore's insert of the rows,
    rolled back (the same file, nothing kept)."""
    _adapters(on, saved)
    conn = with_history_functions(sqlite3.connect(path, isolation_level=None))
    try:
        conn.execute("BEGIN")
        began = time.thread_time()
        insert_rows(conn, "restore_tasks", len(TASK_ROW) + 1, rows)
        spent = time.thread_time() - began
        conn.execute("ROLLBACK")
    finally:
        conn.close()
    return spent / len(rows) * 1e6


async def bench_binding(n: int, rounds: int = 5) -> None:
    """What `bind_without_adapting` (bridge/store/database.py) saves: the restore's task rows (mostly NULLs, a blob)
    inserted with the identity adapters for None and bytes, and without them (sqlite3's adapter lookup for each
    such value), alternated in one process."""
    from bench.bench_changelog import task_record  # not at the top: bench_changelog imports this module

    saved = {key: sqlite3.adapters[key] for key in _IDENTITY}
    picked = pick_last([(i, *task_record(i, "orders", 5)) for i in range(n)])
    rows = [row.task for row in picked.last.values() if row is not None]
    nulls = sum(value is None for value in rows[0])
    without: list[float] = []
    adapted: list[float] = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        store = await Store.open(Path(tmp) / "bind.db")  # the store's schema, its indexes and triggers
        await store.close()
        try:
            for _ in range(rounds):
                without.append(_bind_rounds(store.path, rows, False, saved))
                adapted.append(_bind_rounds(store.path, rows, True, saved))
        finally:
            _adapters(True, saved)
    ratio = statistics.median(adapted) / statistics.median(without)
    record("binding a restored task's NULLs and blobs: identity adapters vs sqlite3's adapter lookup", [
        f"rows: {n} restored tasks (the restore's insert, {len(rows[0])} values a row, {nulls} of them NULL, one "
        f"blob), rolled back; {rounds} rounds alternated; CPU of the inserting thread",
        f"baseline, no adapters (sqlite3 looks each NULL and blob up): {_spread(without)} us a row",
        f"identity adapters for None and bytes (the bridge's): {_spread(adapted)} us a row; "
        f"CPU median/median {ratio:.2f}",
    ])


async def bench_lane(n: int, rounds: int = 7) -> None:
    """What a partition's lane adds to a record, no Kafka: n records through a real lane (its runner on a handler
    thread, the results taken on the loop, the offsets tracked as the consumer does) against the same handler
    called with its context in a plain loop, alternated in one process; CPU of the whole process a record."""
    from bench.bench_kafka import Finished, bench_config, counted_ok  # not at the top: it imports Kafka clients

    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config = bench_config("127.0.0.1:9", Path(tmp), {"handler": "ok"})  # no broker is contacted
    registry = counted_ok(Finished(n))
    handler = registry.get("ok")
    assert handler is not None
    delivery = FirstDelivery(None, LiveConfig(config), registry, SystemClock(), None, "bench")  # type: ignore[arg-type]
    batches = [[SourceRecord("in", 0, i, None, b"x" * 1000, 0, ()).fetched()
                for i in range(start, min(n, start + 500))]
               for start in range(0, n, 500)]
    bare: list[float] = []
    laned: list[float] = []
    for _ in range(rounds):
        began = time.process_time()
        for batch in batches:
            for r in batch:
                headers = {"rdq.source": f"kafka://{r.topic()}/{r.partition()}/{r.offset()}"}
                handler.fn(HandlerContext("t", "q", 1, 0, r.value(), "application/octet-stream", headers))
        bare.append((time.process_time() - began) / n * 1e6)
        laned.append(await _through_a_lane(delivery, batches, n))
    ratio = statistics.median(laned) / statistics.median(bare)
    record("a lane's runner vs the handler alone, no Kafka", [
        f"records: {n}, polls of 500 into one lane (one runner on a handler thread, results taken on the loop, "
        f"offsets tracked); {rounds} rounds alternated; CPU of the process a record",
        f"baseline, the ok handler and its context in a plain loop: {_spread(bare)} us a record",
        f"through the lane: {_spread(laned)} us a record; median/median {ratio:.2f}",
    ])


async def _through_a_lane(delivery: FirstDelivery, batches: list[list[Fetched]], n: int) -> float:
    threads = HandlerThreads(lambda queue: 4)
    tracker = PartitionTracker()
    finished = asyncio.Event()
    seen = 0

    def on_results(lane: Lane, results: Results) -> None:
        nonlocal seen
        delivery.count("q", results)
        tracker.done_many(results.done_offsets())
        seen += len(results)
        if seen >= n:
            finished.set()

    lane = Lane(("in", 0), "q", delivery, threads, 16, on_results, lambda offset: False)
    began = time.process_time()
    for batch in batches:
        tracker.fetched_many([r.offset() for r in batch])
        lane.add(batch)
        for _ in itertools.count():  # as the consumer pauses a partition past its share
            if lane.backlog <= 2000:
                break
            await asyncio.sleep(0.001)
    await asyncio.wait_for(finished.wait(), 600)
    cpu = (time.process_time() - began) / n * 1e6
    threads.shutdown()
    return cpu


def _spread(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{ordered[0]:.1f}/{statistics.median(ordered):.1f}/{ordered[-1]:.1f} (min/median/max)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["failures", "retry", "scale", "binding", "lane", "all"])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--claims", type=int, default=500)
    args = parser.parse_args()
    if args.which in ("failures", "all"):
        asyncio.run(bench_failures(args.n, args.batch))
    if args.which in ("retry", "all"):
        asyncio.run(bench_retry(args.n))
    if args.which in ("scale", "all"):
        asyncio.run(bench_scale([int(s) for s in args.sizes.split(",")], args.claims))
    if args.which in ("binding", "all"):
        asyncio.run(bench_binding(args.n))
    if args.which in ("lane", "all"):
        asyncio.run(bench_lane(args.n))


if __name__ == "__main__":
    main()
