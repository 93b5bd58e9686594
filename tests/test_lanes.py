"""Lanes (bridge/lanes.py): a partition's first deliveries run by a few runners, not a task and a hop per record.

Real handler threads, a real SQLite store on disk; the records are built here (the Kafka path is covered by
test_kafka_path and the fault suite).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from bridge.clock import SystemClock
from bridge.engine.threads import HandlerThreads
from bridge.handler_api import HandlerContext
from bridge.live_config import LiveConfig
from bridge.model import Outcome, Status
from bridge.records import Fetched, SourceRecord
from bridge.registry import Registry
from bridge.source.ends import Begun, Ran, Results
from bridge.source.first_delivery import FirstDelivery
from bridge.source.lanes import Lane
from bridge.source.runners import Runner
from bridge.store.tasks import Store
from tests.helpers import engine_config, eventually


class Rig:
    """One lane of queue q over a real store, collecting what the lane reports."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.registry = Registry()
        self.results: list[Ran] = []
        self.store: Store | None = None
        self.threads: HandlerThreads | None = None
        self.stores_keys = False  # as the consumer does once a batch's failures are stored: `lane.stored(keys)`

    async def lane(self, handler: Callable[..., Any], limit: int = 16,
                   on_failure: Callable[[Lane, Ran], None] | None = None, **queue: Any) -> Lane:
        self.registry.register("h", handler)
        config = engine_config(str(self.tmp_path / "rdq.db"), q={"handler": "h", **queue})
        self.store = await Store.open(config.store.path)
        self.threads = HandlerThreads(lambda q: 8 + limit)
        self.delivery = FirstDelivery(self.store, LiveConfig(config), self.registry, SystemClock(), self.threads,
                                      "test-1")
        return Lane(("t", 0), "q", self.delivery, self.threads, limit, self._collect, lambda offset: False,
                    on_failure)

    def _collect(self, lane: Lane, results: Results) -> None:
        # A chunk's successes come as (record, seconds) pairs: seen here as the Ran each stands for.
        self.results.extend(results.ran)
        self.results.extend(Ran(_as_record(record), "q", None, Outcome.SUCCESS, took) for record, took in results.ok)
        if self.stores_keys and results.failures():
            lane.stored([ran.record.key for ran in results.failures()])

    async def close(self) -> None:
        if self.threads is not None:
            self.threads.shutdown()
        if self.store is not None:
            await self.store.close()


def _as_record(fetched: Fetched) -> SourceRecord:
    """What the rig keeps of a success: its offset and key (not `SourceRecord.from_message`, which a test counts)."""
    return SourceRecord(fetched.topic(), fetched.partition(), fetched.offset(), fetched.key(), b"", None, ())


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = Rig(tmp_path)
    yield r
    await r.close()


def records(n: int, payload: bytes = b"{}") -> list[Fetched]:
    """Records as a lane holds them, fetched (here, SourceRecords in the fetched Message's shape)."""
    return [SourceRecord("t", 0, i, None, payload, None, ()).fetched() for i in range(n)]


async def watchdog(lane: Lane) -> None:
    """The consumer's watchdog over one lane: a round every 50 ms."""
    while True:
        await asyncio.sleep(0.05)
        lane.watch(time.monotonic())


async def run_watched(rig: Rig, lane: Lane, n: int, release: threading.Event) -> None:
    """n records through the lane under the consumer's watchdog (every 50 ms), until all are reported; then the
    hung handler is released."""
    dog = asyncio.create_task(watchdog(lane))
    try:
        lane.add(records(n))
        assert await eventually(lambda: len(rig.results) == n, within=10)
    finally:
        dog.cancel()
        release.set()


async def test_a_fast_sync_handler_runs_on_one_runner_in_offset_order(rig: Rig) -> None:
    seen: list[int] = []
    threads: set[int] = set()

    def fast(ctx: HandlerContext) -> None:
        seen.append(int(ctx.source.rsplit("/", 1)[1]))
        threads.add(threading.get_ident())

    lane = await rig.lane(fast)
    lane.add(records(2000))
    assert await eventually(lambda: len(rig.results) == 2000)
    assert all(r.task is None for r in rig.results)
    # One hop onto the handler threads ran them (a runner per record would have spread them over the pool).
    assert len(threads) == 1
    assert seen == list(range(2000))


async def test_a_slow_sync_handler_gets_the_partitions_concurrency(rig: Rig) -> None:
    running = 0
    most = 0
    lock = threading.Lock()

    def slow(ctx: HandlerContext) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)  # waits on I/O, say
        with lock:
            running -= 1

    lane = await rig.lane(slow, limit=8)
    began = time.monotonic()
    lane.add(records(64))
    assert await eventually(lambda: len(rig.results) == 64, within=20)
    assert most == 8  # up to the limit, never past it
    assert time.monotonic() - began < 64 * 0.05 / 2  # well under what one runner would take (3.2 s)


async def test_a_hung_record_is_abandoned_after_its_lease_and_the_records_behind_it_run(rig: Rig) -> None:
    release = threading.Event()

    def hangs_on_first(ctx: HandlerContext) -> None:
        if ctx.source.endswith("/0"):
            release.wait(30)  # never heartbeats

    lane = await rig.lane(hangs_on_first, limit=1, lease="300ms")
    await run_watched(rig, lane, 5, release)
    by_offset = {r.record.offset: r for r in rig.results}
    hung = by_offset[0].task
    assert hung is not None and hung.first_attempt is not None
    assert hung.first_attempt.outcome == Outcome.LEASE_EXPIRED and hung.status == Status.PENDING
    assert all(by_offset[i].task is None for i in range(1, 5))
    # Its thread is counted stuck until the handler returns; its late success is not reported again.
    assert rig.threads is not None and rig.threads.stuck() == {"q": 1}
    await asyncio.sleep(0.2)
    assert len(rig.results) == 5


async def test_a_hung_records_late_failure_is_neither_reported_nor_counted_again(rig: Rig) -> None:
    """The watchdog reported the abandoned record (and the failure hook counted its open task): when its handler
    finally raises, the runner drops what it returns, and the records behind it ran on another runner."""
    release = threading.Event()
    failures: list[int] = []

    def hangs_then_fails(ctx: HandlerContext) -> None:
        if ctx.source.endswith("/0"):
            release.wait(30)
            raise ConnectionError("down, at last")

    lane = await rig.lane(hangs_then_fails, limit=1, lease="300ms",
                          on_failure=lambda lane, ran: failures.append(ran.record.offset))
    await run_watched(rig, lane, 5, release)
    await asyncio.sleep(0.3)
    assert sorted(r.record.offset for r in rig.results) == [0, 1, 2, 3, 4]
    assert failures == [0]
    hung = next(r for r in rig.results if r.record.offset == 0).task
    assert hung is not None and hung.first_attempt is not None
    assert hung.first_attempt.outcome == Outcome.LEASE_EXPIRED


async def test_a_failure_can_hold_the_lane_before_the_runner_takes_its_next_record(rig: Rig) -> None:
    """max_open_tasks: the consumer counts a failure as it happens and may hold the lane at once; the runner that
    reported it must take nothing more, or a burst would run past the limit."""
    ran: list[int] = []

    def fails(ctx: HandlerContext) -> None:
        ran.append(offset_of(ctx))
        raise ConnectionError("down")

    lane = await rig.lane(fails, limit=1, on_failure=hold)
    lane.add(records(10))
    assert await eventually(lambda: len(rig.results) == 1)
    await asyncio.sleep(0.3)
    assert ran == [0] and len(rig.results) == 1 and lane.backlog == 9


def hold(lane: Lane, result: Ran) -> None:
    """An on_failure that holds the lane at once (as max_open_tasks does)."""
    lane.held = True


def offset_of(ctx: HandlerContext) -> int:
    return int(ctx.source.rsplit("/", 1)[1])


async def test_records_in_a_chunk_behind_a_hung_one_are_handed_back_and_run_by_another_runner(rig: Rig) -> None:
    """A runner takes its records a chunk at a time (chunks double while records are fast: record 100 is in the
    one of 63-126). The records behind a hung one in its chunk must not wait for its lease: the watchdog hands
    them back and another runner runs them."""
    release = threading.Event()

    def hangs_on_100(ctx: HandlerContext) -> None:
        if offset_of(ctx) == 100:
            release.wait(30)

    lane = await rig.lane(hangs_on_100, limit=2, lease="30s")
    dog = asyncio.create_task(watchdog(lane))
    try:
        lane.add(records(300))
        assert await eventually(lambda: len(rig.results) == 299, within=5)
        assert sorted(r.record.offset for r in rig.results) == [i for i in range(300) if i != 100]
        assert all(r.task is None for r in rig.results)
    finally:
        dog.cancel()
        release.set()
    assert await eventually(lambda: len(rig.results) == 300)
    await asyncio.sleep(0.2)
    assert sorted(r.record.offset for r in rig.results) == list(range(300))  # each once


async def test_the_records_of_a_chunk_before_an_abandoned_one_are_reported_once_each(rig: Rig) -> None:
    """The watchdog ends a hung record of a chunk (its claim): the successes the runner ran before it in the same
    chunk are still reported, each once, and the hung one's late success is not."""
    release = threading.Event()

    def hangs_on_70(ctx: HandlerContext) -> None:
        if offset_of(ctx) == 70:
            release.wait(30)  # never heartbeats

    lane = await rig.lane(hangs_on_70, limit=1, lease="300ms")
    await run_watched(rig, lane, 200, release)
    await asyncio.sleep(0.3)
    assert sorted(r.record.offset for r in rig.results) == list(range(200))
    by_offset = {r.record.offset: r for r in rig.results}
    hung = by_offset[70].task
    assert hung is not None and hung.first_attempt is not None
    assert hung.first_attempt.outcome == Outcome.LEASE_EXPIRED


async def test_a_failure_that_holds_the_lane_mid_chunk_hands_the_rest_back_unrun(rig: Rig) -> None:
    """max_open_tasks inside a chunk: the records after the failure that held the lane are not run; they are the
    lane's again (its backlog and bytes), and run once it is released."""
    ran: list[int] = []

    def fails_on_100(ctx: HandlerContext) -> None:
        ran.append(offset_of(ctx))
        if offset_of(ctx) == 100:
            raise ConnectionError("down")

    lane = await rig.lane(fails_on_100, limit=1, on_failure=hold)
    lane.add(records(300))
    assert await eventually(lambda: len(rig.results) == 101)
    await asyncio.sleep(0.3)
    assert ran == list(range(101)) and len(rig.results) == 101
    assert lane.backlog == 199 and lane.ready_bytes == 199 * 2
    lane.held = False
    lane.dispatch()
    assert await eventually(lambda: len(rig.results) == 300)
    assert ran == list(range(300)) and lane.ready_bytes == 0


async def test_the_failures_of_a_batch_are_stored_in_a_few_group_commits(rig: Rig) -> None:
    def fails(ctx: HandlerContext) -> None:
        raise ConnectionError("down")

    lane = await rig.lane(fails, max_attempts=3)
    lane.add(records(1000))
    assert await eventually(lambda: len(rig.results) == 1000, within=20)
    assert rig.store is not None
    before = rig.store.stats.batches
    stored = await rig.delivery.store_all([r.task for r in rig.results if r.task is not None])
    assert len(stored) == 1000 and all(s.status == Status.PENDING for s in stored)
    assert rig.store.stats.batches - before <= 2  # one transaction (two if the first began early)
    counts = await rig.store.counts()
    assert counts["q"]["PENDING"] == 1000


async def test_a_held_lane_starts_nothing_until_released(rig: Rig) -> None:
    ran: list[int] = []
    lane = await rig.lane(lambda ctx: ran.append(1))
    lane.held = True
    lane.add(records(10))
    await asyncio.sleep(0.2)
    assert ran == [] and len(lane.ready) == 10 and lane.ready_bytes == 20
    lane.held = False
    lane.dispatch()
    assert await eventually(lambda: len(rig.results) == 10)
    assert lane.ready_bytes == 0


async def test_an_async_handler_runs_without_a_task_per_record_and_ramps_up_when_it_waits(rig: Rig) -> None:
    running = 0
    most = 0

    async def waits(ctx: HandlerContext) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.02)
        running -= 1

    lane = await rig.lane(waits, limit=16)
    lane.add(records(160))
    assert await eventually(lambda: len(rig.results) == 160, within=20)
    assert most == 16


def test_a_failures_stack_reads_as_pythons_own_without_the_carets() -> None:
    """format_stack skips what makes traceback.format_exception slow (a stat per frame, a parse per line for
    the ^^^ markers); its text is otherwise the same, chained exceptions included."""
    import re
    import traceback

    from bridge.engine.runner import format_stack

    def inner() -> None:
        raise ValueError("boom")

    def caused() -> None:
        try:
            inner()
        except ValueError as e:
            raise ConnectionError("down") from e

    def during() -> None:
        try:
            caused()
        except ConnectionError:
            {}["missing"]  # raises KeyError while handling

    for fail in (inner, caused, during):
        try:
            fail()
        except Exception as e:
            lines = "".join(traceback.format_exception(e)).splitlines(keepends=True)
            expected = "".join(line for line in lines if not re.fullmatch(r"\s*[~^]+\s*", line))
            assert format_stack(e) == expected


def test_a_failures_last_line_reads_as_pythons_own_whatever_the_exception() -> None:
    """The exception's own line is written without `traceback.TracebackException` (it walked the tracebacks again);
    it must still read as Python's: module-qualified names, an empty message, a str() that raises, notes of every
    shape, an exception group, and a SyntaxError's own layout."""
    import traceback

    from bridge.engine.runner import format_stack

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    class Elsewhere(Exception):
        pass

    Elsewhere.__module__ = "payments.client"
    noted = ValueError("noted")
    noted.add_note("first note\nits second line")
    noted.add_note("")
    odd_notes, not_a_sequence = ValueError("odd"), ValueError("not a sequence")
    odd_notes.__notes__ = "abc"  # type: ignore[attr-defined]
    not_a_sequence.__notes__ = 42  # type: ignore[attr-defined]
    failures: list[BaseException] = [
        ValueError(), KeyError("k"), Unprintable("x"), Elsewhere("two\nlines"), noted, odd_notes, not_a_sequence,
        ExceptionGroup("several", [ValueError(1), TypeError(2)]), SyntaxError("bad", ("f.py", 3, 4, "x = = 1", 3, 6)),
        KeyboardInterrupt()]
    for failure in failures:
        try:
            raise failure
        except BaseException as e:
            assert format_stack(e).endswith("".join(traceback.format_exception_only(e))), failure


async def test_a_keys_next_record_waits_until_its_failed_record_is_stored(rig: Rig) -> None:
    """ordering: key. A record that became a task blocks its key; the key's next record must not be parked (or run)
    before that task is in the store: a head whose insert failed and was retried let a later record find no open
    task (stored PENDING, run beside the head) or be stored first (the retried head then looked like a redelivery
    and was dropped: acknowledged, never stored)."""
    def fails_first(ctx: HandlerContext) -> None:
        if ctx.source.endswith("/0"):
            raise ConnectionError("down")

    lane = await rig.lane(fails_first, ordering="key")
    lane.load_keys(set())
    lane.add([SourceRecord("t", 0, i, b"K", b"{}", None, ()).fetched() for i in range(3)])
    assert await eventually(lambda: len(rig.results) >= 1)
    await asyncio.sleep(0.3)
    assert [r.record.offset for r in rig.results] == [0] and rig.results[0].task is not None
    assert lane.backlog == 2  # 1 and 2 wait for 0's task to be stored
    lane.stored([b"K"])  # 0's task is in the store now
    assert await eventually(lambda: len(rig.results) >= 2)
    await asyncio.sleep(0.3)
    assert [r.record.offset for r in rig.results] == [0, 1]
    assert rig.results[1].task is not None and rig.results[1].task.status == Status.PARKED
    lane.stored([b"K"])
    assert await eventually(lambda: [r.record.offset for r in rig.results] == [0, 1, 2])


def keyed(n: int, keys: int) -> list[Fetched]:
    """n records of `keys` distinct keys in turn (offset i has key i % keys)."""
    return [SourceRecord("t", 0, i, str(i % keys).encode(), b"{}", None, ()).fetched() for i in range(n)]


async def run_keyed(rig: Rig, handler: Callable[..., Any], n: int) -> tuple[Lane, dict[int, Ran]]:
    """`keyed(n, 10)` through an ordered lane (limit 4) whose failures' tasks the store confirms: once all n are
    reported, each once, the lane and what each record became."""
    rig.stores_keys = True
    lane = await rig.lane(handler, limit=4, ordering="key")
    lane.load_keys(set())
    lane.add(keyed(n, 10))
    assert await eventually(lambda: len(rig.results) == n, within=10)
    by_offset = {r.record.offset: r for r in rig.results}
    assert len(by_offset) == n
    return lane, by_offset


class KeyRecorder:
    """A sync handler for an ordered lane of `keyed(n, 10)` records: notes each key's records in the order they
    ran, and any time two records of one key ran at once."""

    def __init__(self, fails: int | None = None, hangs: int | None = None) -> None:
        self.ran: dict[int, list[int]] = {}
        self.overlaps: list[int] = []
        self.fails, self.hangs = fails, hangs
        self.release = threading.Event()
        self._running: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self, ctx: HandlerContext) -> None:
        offset = offset_of(ctx)
        key = offset % 10  # keyed(n, 10)
        with self._lock:
            if key in self._running:
                self.overlaps.append(offset)
            self._running.add(key)
            self.ran.setdefault(key, []).append(offset)
        try:
            if offset == self.hangs:
                self.release.wait(30)
            if offset == self.fails:
                raise ConnectionError("down")
        finally:
            with self._lock:
                self._running.discard(key)


async def test_an_ordered_lanes_chunks_hold_one_record_a_key_and_park_a_failed_keys_later_records(
        rig: Rig) -> None:
    """ordering: key through chunks (chunks grow to 128 records while records are fast; 10 keys in turn). Record
    205 (key 5) fails: key 5's later records must be parked, not run — whether they were in the same chunk or
    arrive after — and every other key's records run once each, in offset order."""
    handler = KeyRecorder(fails=205)
    lane, by_offset = await run_keyed(rig, handler, 1000)
    assert handler.overlaps == []
    assert handler.ran[5] == list(range(5, 206, 10))  # nothing of key 5 ran after its failure
    parked = [o for o in range(215, 1000, 10)]
    assert all((t := by_offset[o].task) is not None and t.status == Status.PARKED for o in parked)
    for key in set(range(10)) - {5}:
        assert handler.ran[key] == list(range(key, 1000, 10))
        assert all(by_offset[o].task is None for o in handler.ran[key])
    assert lane.backlog == 0 and lane.ready_bytes == 0


async def test_an_ordered_chunk_behind_a_hung_record_is_handed_back_with_its_keys_free(rig: Rig) -> None:
    """ordering: key. Record 100 (key 0) hangs inside a chunk: the watchdog hands the rest of the chunk back, its
    records' keys no longer running, and takes the successes the runner ran before it (their keys free too), so
    another runner runs every other key's records; key 0's later records wait for 100 and then run in order."""
    handler = KeyRecorder(hangs=100)
    lane = await rig.lane(handler, limit=2, lease="30s", ordering="key")
    lane.load_keys(set())
    dog = asyncio.create_task(watchdog(lane))
    try:
        lane.add(keyed(500, 10))
        others = [o for o in range(500) if o % 10 or o < 100]
        done = await eventually(lambda: len(rig.results) == len(others), within=5)
        assert done, (len(rig.results), sorted(set(others) - {r.record.offset for r in rig.results})[:20])
        assert sorted(r.record.offset for r in rig.results) == others
        assert handler.ran[0] == list(range(0, 101, 10))  # key 0's later records wait behind the hung one
    finally:
        dog.cancel()
        handler.release.set()
    assert await eventually(lambda: len(rig.results) == 500)
    await asyncio.sleep(0.2)
    assert sorted(r.record.offset for r in rig.results) == list(range(500))  # each once
    assert handler.overlaps == [] and all(r.task is None for r in rig.results)
    assert all(handler.ran[key] == list(range(key, 500, 10)) for key in range(10))


async def test_a_batchs_first_attempts_reach_the_breaker_and_the_metrics_with_its_chunked_successes(
        rig: Rig) -> None:
    """A lane's successes come as a count beside the failures' outcomes: the circuit breaker's hook and the
    attempt metrics must weigh them as they weigh any attempt (left out, a few failures among many fast
    successes would look like an outage and trip the breaker)."""
    def fails_every_tenth(ctx: HandlerContext) -> None:
        if offset_of(ctx) % 10 == 9:
            raise ConnectionError("down")

    seen: list[tuple[list[Outcome], int]] = []
    lane = await rig.lane(fails_every_tenth, limit=1)
    rig.delivery.hooks.first_attempts.subscribe(lambda queue, outcomes, successes: seen.append((outcomes, successes)))
    batches: list[Results] = []
    lane._on_results = lambda lane, results: (batches.append(results), rig.delivery.count("q", results))
    lane.add(records(300))
    assert await eventually(lambda: sum(len(r) for r in batches) == 300)
    assert sum(len(r.ok) for r in batches) > 0  # chunks did report successes as pairs
    assert sum(n for _, n in seen) + sum(o.count(Outcome.SUCCESS) for o, _ in seen) == 270
    assert sum(o.count(Outcome.RETRYABLE_FAILURE) for o, _ in seen) == 30
    metrics = rig.delivery.telemetry.metrics.attempts
    assert metrics.total("q", Outcome.SUCCESS) == 270 and metrics.total("q", Outcome.RETRYABLE_FAILURE) == 30


async def test_an_async_handlers_ordered_lane_runs_each_key_in_order_and_parks_after_a_failure(rig: Rig) -> None:
    """ordering: key with an async handler: its runners take a record at a time (`LaneKeys.next_ready`), the
    handler suspending so a second runner runs beside the first — never two of a key, each key in order, and
    record 105 (key 5) failing parks key 5's later records."""
    ran: dict[int, list[int]] = {}
    running: set[int] = set()
    overlaps: list[int] = []

    async def suspends(ctx: HandlerContext) -> None:
        offset = offset_of(ctx)
        key = offset % 10
        if key in running:
            overlaps.append(offset)
        running.add(key)
        ran.setdefault(key, []).append(offset)
        try:
            await asyncio.sleep(0.002 if offset % 3 == 0 else 0)  # suspended: another runner takes the next
            if offset == 105:
                raise ConnectionError("down")
        finally:
            running.discard(key)

    _, by_offset = await run_keyed(rig, suspends, 300)
    assert overlaps == []
    assert ran[5] == list(range(5, 106, 10))
    assert all((t := by_offset[o].task) is not None and t.status == Status.PARKED for o in range(115, 300, 10))
    assert all(ran[key] == list(range(key, 300, 10)) for key in set(range(10)) - {5})


class Message:
    """A fetched record with confluent-kafka's Message methods (its constructor is for tests only from 2.13 on)."""

    def __init__(self, offset: int, key: bytes | None, value: bytes,
                 headers: list[tuple[str, bytes | None]] | None) -> None:
        self._offset, self._key, self._value, self._headers = offset, key, value, headers

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000 + self._offset)

    def __len__(self) -> int:
        return len(self._value)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_success_on_the_common_path_makes_no_source_record_and_a_failure_keeps_all_of_its_record(
        rig: Rig, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The common path (a handler here, sync on handler threads or async on the loop, tracing off) runs a record
    as fetched: a success is the fetched record and its seconds, no SourceRecord made; the record that fails
    becomes one with all it carried — key, headers, timestamp, content type — and its task's attempt starts when
    its handler began."""
    made: list[int] = []
    from_message = SourceRecord.from_message
    monkeypatch.setattr(SourceRecord, "from_message", classmethod(
        lambda cls, msg: made.append(msg.offset()) or from_message(msg)))
    seen: list[tuple[str, str, bytes]] = []

    def sync_handler(ctx: HandlerContext) -> None:
        seen.append((ctx.source, ctx.content_type, ctx.payload))
        if ctx.payload == b"fail":
            raise ValueError("no")

    async def async_handler(ctx: HandlerContext) -> None:
        sync_handler(ctx)

    handler = sync_handler if kind == "sync" else async_handler
    headers = [("content-type", b"text/plain"), ("x-bin", b"\xff\x00")]
    fetched = [Message(i, b"k%d" % i, b"fail" if i == 7 else b"{}", headers if i % 2 else None) for i in range(20)]
    lane = await rig.lane(handler)
    before = time.time()
    lane.add(fetched)  # type: ignore[arg-type]  (the test's Message has the methods a lane reads)
    assert await eventually(lambda: len(rig.results) == 20)
    assert made == [7]  # only the failure became a SourceRecord
    assert seen[3] == ("kafka://t/0/3", "text/plain", b"{}") and seen[4] == ("kafka://t/0/4",
                                                                               "application/octet-stream", b"{}")
    failure = next(r for r in rig.results if r.task is not None)
    assert failure.record == SourceRecord("t", 0, 7, b"k7", b"fail", 1_700_000_000_007, tuple(headers))
    task = failure.task
    assert task is not None and task.payload_content_type == "text/plain"
    assert task.headers["rdq.source"] == "kafka://t/0/7" and task.headers["rdq.kafka.key"] == "azc="
    assert task.first_attempt is not None
    assert before * 1000 - 5 <= task.first_attempt.started_at <= task.first_attempt.finished_at


async def test_the_watchdog_never_abandons_the_record_a_runner_began_after_the_overdue_one_ended(rig: Rig) -> None:
    """The watchdog reads a runner's record, finds it overdue and ends it — while the runner, on its own thread and
    without the lane's lock, may end that record and begin the next one in between. The watchdog must end only
    the record it found overdue: here the runner ends A and begins B right as A is judged (between the read and
    the end), so the watchdog ends nothing; B stays the runner's, A is the runner's success to report."""
    lane = await rig.lane(lambda ctx: None)
    plan = lane.delivery.plan("q")
    assert plan is not None
    runner = Runner()

    class OverdueA(Begun):
        __slots__ = ()

        def overdue(self, now: float) -> str | None:
            assert runner.end()  # the runner's handler returned: A is the runner's to report...
            runner.current = b  # ...and it began B
            return "silent"  # A was overdue when the watchdog looked

    first, second = records(2)
    a = FirstDelivery.begin(plan, first)
    a = OverdueA(a.record, a.queue_name, a.queue, a.handler, a.ctx, None, a.began, False)
    b = FirstDelivery.begin(plan, second)
    runner.current = a
    lane._runners.add(runner)
    lane.watch(time.monotonic())
    await asyncio.sleep(0.05)
    assert rig.results == []  # nothing abandoned: A ended as the runner's success, not the watchdog's failure
    assert not runner.abandoned and runner.current is b and runner.end()  # B is still the runner's to end


async def test_records_put_back_run_again_ahead_of_the_others_and_their_bytes_are_counted(rig: Rig) -> None:
    """A batch whose failures could not be stored is put back (the consumer's `_store_failures`): its records, as
    SourceRecords, go back in front of the lane in their order, counted in the lane's bytes, and run again."""
    seen: list[int] = []
    lane = await rig.lane(lambda ctx: seen.append(int(ctx.source.rsplit("/", 1)[1])))
    lane.held = True
    lane.add([SourceRecord("t", 0, i, None, b"x" * 10, None, ()).fetched() for i in range(5, 8)])
    lane.put_back([SourceRecord("t", 0, i, b"k", b"y" * 7, 1_700_000_000_000, (("h", b"\xff"),)) for i in (1, 3)])
    assert lane.ready_bytes == 3 * 10 + 2 * 7
    lane.held = False
    lane.dispatch()
    assert await eventually(lambda: len(rig.results) == 5)
    assert seen == [1, 3, 5, 6, 7] and lane.ready_bytes == 0
