"""The source consumer (SPEC §4.1, §4.10, §5.1, §5.2, §5.4): at-least-once, concurrent within a partition.

- Every confluent-kafka call runs on one dedicated thread; rebalance callbacks run there too (inside consume).
- A record's offset is stored for commit only once it is done (succeeded or its task durably stored), and never
  past a record that is not: the commit is the highest contiguous done offset of each partition.
- Before a batch's handlers start, each partition's in-flight offset range is journaled (one write per batch): if
  the process dies, those records come back marked as suspects and become tasks instead of running inline again.
- With the changelog (SPEC §10) an assigned partition is first restored from its changelog (not consumed
  meanwhile); a stored failure's offset moves only once its task is in the changelog; offsets are committed in
  the changelog writer's transactions; a revoked partition hands its tasks over (finish or release, flush, drop).
- A partition is paused while too many of its fetched records wait for a slot, while its queue is over
  `max_open_tasks`, while the store cannot be written, and while its queue is paused by an operator; it resumes
  by itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition

from bridge.changelog.local import LocalIndex
from bridge.changelog.restore import RestoreFailed, Restorer, RestoreReport
from bridge.changelog.writer import ChangelogWriter
from bridge.clock import Clock
from bridge.config import BridgeConfig
from bridge.live_config import LiveConfig
from bridge.model import Status, key_of_order_key, order_key_of, parse_order_key
from bridge.records import SourceRecord
from bridge.source.first_delivery import FirstDelivery, Ran
from bridge.source.lanes import CpuLoad, Lane
from bridge.source.offsets import PartitionTracker
from bridge.store.database import StoreError
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)
TP = tuple[str, int]
_BATCH = 500
_FIRST_POLL = 4
_BACKLOG_HIGH = 2000  # fetched records waiting per partition before it is paused
_POLL_TIMEOUT = 0.1
_OFFSET_FLUSH_INTERVAL = 0.2
_BACKPRESSURE_INTERVAL = 0.25
_RESUME_FRACTION = 0.9
_JOURNALS_IN_FLIGHT = 4  # fetched batches waiting for their journal write before the poll waits too
_WATCH_INTERVAL = 0.05  # how late past its lease a hung first delivery may be noticed
_KEYS_INTERVAL = 0.2  # ordering: key — how often blocked keys are checked against the store (a freed key's next
# records are parked, then released by the store's trigger, until then: slower, never out of order)
_FLUSH_TIMEOUT = 15.0  # a revoke's last changelog transaction (the writer's own timeouts are shorter)


class Changelog:
    """What the consumer needs of the changelog: restore on assign, the writer for offsets, hand-over on revoke."""

    def __init__(self, local: LocalIndex, writer: ChangelogWriter, restorer: Restorer,
                 hand_over: Callable[[set[TP], float], Any], telemetry: Telemetry,
                 ensure_topics: Callable[[], Awaitable[dict[str, str]]] | None = None) -> None:
        self.ensure_topics = ensure_topics  # creates or checks the changelogs of sources that appeared since
        self.local = local
        self.writer = writer
        self.restorer = restorer
        self.hand_over = hand_over
        self.telemetry = telemetry


def _first(value: int | None, default: int) -> int:
    return default if value is None else value  # not `value or default`: offset 0 is an offset


class SourceConsumer:
    def __init__(self, config: BridgeConfig, live: LiveConfig, delivery: FirstDelivery, store: Store, run_id: str,
                 clock: Clock, consumer_factory: Callable[[], Consumer], grace_period: float = 10.0,
                 paused_queues: Callable[[], set[str]] | None = None, changelog: Changelog | None = None) -> None:
        self.config = config
        self.live = live
        self.delivery = delivery
        self.store = store
        self.run_id = run_id
        self.clock = clock
        self.grace_period = grace_period
        self._consumer_factory = consumer_factory
        self._operator_paused = paused_queues or (lambda: set())
        self._consumer: Consumer | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rdq-kafka-consumer")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._trackers: dict[TP, PartitionTracker] = {}
        self._lanes: dict[TP, Lane] = {}
        self._journaling: deque[asyncio.Task[None]] = deque()  # fetched batches whose journal write is pending
        # Records asked of one poll: a few at first, more as their sizes show the budget allows (_size_polls).
        self._poll_size = _FIRST_POLL
        self._load = CpuLoad()  # more runners for slow handlers only while the process is not computing flat out
        self._storing: dict[TP, set[asyncio.Task[None]]] = {}  # failures of a lane being stored
        self._suspects: dict[TP, list[tuple[int, int]]] = {}
        self._paused: set[TP] = set()
        self._assigned: set[TP] = set()
        self._backpressured: set[str] = set()
        self._open_tasks: dict[str, int] = {}
        self._was_held: set[str] = set()
        self._store_healthy = True
        self.changelog = changelog
        self._restoring: set[TP] = set()
        self._baseline: dict[TP, int] = {}  # committed offset found at assignment
        self._restores: set[asyncio.Task[None]] = set()
        # A lost partition's store clean-up under way: assigned again meanwhile, its restore waits for it.
        self._losing: dict[TP, concurrent.futures.Future[None]] = {}
        # Each assignment of a partition (counted on the consumer thread): a restore belongs to one, and a restore
        # of an earlier one (lost, then assigned again) neither goes on nor makes the partition ready.
        self._epochs: dict[TP, int] = {}
        self._restored: dict[TP, dict[str, Any]] = {}  # the last restore of each partition: tasks, seconds
        # Both replaced whole on the consumer thread (rebalance callbacks), read by the changelog writer's thread.
        self._metadata: Any | None = None
        self._writable: frozenset[TP] = frozenset()
        self.stats = {"records": 0, "suspects": 0}

    # ---- plumbing ------------------------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        assert self._loop is not None
        return await self._loop.run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    def set_store_health(self, healthy: bool) -> None:
        if healthy != self._store_healthy:
            log.warning("store %s: consumption %s", "writable again" if healthy else "cannot be written",
                        "resumes" if healthy else "paused")
            self._store_healthy = healthy
            if healthy:
                self._start_all()

    def _start_all(self) -> None:
        for tp in list(self._lanes):
            self._start_ready(tp)

    def owns(self, topic: str, partition: int) -> bool:
        """Is this source partition assigned to this instance now (and restored)?"""
        return (topic, partition) in self._assigned and (topic, partition) not in self._restoring

    @property
    def restoring(self) -> set[TP]:
        return set(self._restoring)

    async def changelog_status(self) -> dict[str, Any]:
        """Per owned partition: open tasks, changelog lag, restore state and figures; unreadable records."""
        if self.changelog is None:
            return {}
        local = self.changelog.local
        known = await local.partitions_status()
        partitions = {}
        for tp in sorted(self._assigned | self._restoring):
            label = f"{tp[0]}/{tp[1]}"
            partitions[label] = {**known.get(label, {"open": 0, "changelog_lag": 0}),
                                 "restoring": tp in self._restoring, **self._restored.get(tp, {})}
        unreadable = await local.unreadable_counts()
        for name, n in unreadable.items():
            self.changelog.telemetry.metrics.changelog_unreadable.labels(name).set(n)
        quarantined = await local.quarantined_counts()
        for name in unreadable:  # a quarantine that ended shows 0
            self.changelog.telemetry.metrics.changelog_quarantined.labels(name).set(quarantined.get(name, 0))
        return {"partitions": partitions, "unreadable": unreadable, "quarantined": quarantined,
                "transactions": dict(self.changelog.writer.stats)}

    def group_metadata(self) -> Any | None:
        """The group metadata of the generation that gave this instance its partitions (taken in the rebalance
        callbacks, not live): once the member is fenced and rejoins, the live one would be valid again while
        this instance has not yet let go of what it lost — and the coordinator checks generations, not which
        member owns a partition. None after a loss, until the next assignment."""
        return self._metadata

    def writable(self) -> frozenset[TP]:
        """The partitions whose tasks and offsets this instance may write now (set on the consumer thread)."""
        return self._writable

    def commit_positions(self) -> dict[TP, int]:
        """What the changelog writer commits for each owned partition: the highest contiguous done offset."""
        out = {}
        for tp in (self._assigned - self._restoring) & self._writable:
            tracker = self._trackers.get(tp)
            offset = tracker.commit_offset() if tracker is not None else None
            if offset is None:
                offset = self._baseline.get(tp)
            if offset is not None:
                out[tp] = offset
        return out

    @property
    def store_healthy(self) -> bool:
        return self._store_healthy

    # ---- the loop ------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        for topic, partition, lo, hi in await self.store.journal_suspects(self.run_id):
            self._suspects.setdefault((topic, partition), []).append((lo, hi))
        if self._suspects:
            log.warning("records in flight when the bridge last stopped will be handled as tasks: %s",
                        {f"{t}/{p}": r for (t, p), r in self._suspects.items()})
        self._consumer = await self._call(self._consumer_factory)
        topics = [t for q in self.config.queues.values() for t in q.sources]
        await self._call(self._consumer.subscribe, topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                         on_lost=self._on_lost)
        pressure = asyncio.create_task(self._watch_backpressure(stop))
        watchdog = asyncio.create_task(self._watch_lanes())
        keys = asyncio.create_task(self._refresh_keys())
        try:
            await self._consume_until(stop)
        finally:
            pressure.cancel()
            try:
                await self._shutdown()
            finally:
                watchdog.cancel()
                keys.cancel()

    async def _consume_until(self, stop: asyncio.Event) -> None:
        assert self._consumer is not None
        next_flush = 0.0
        while not stop.is_set():
            messages = await self._call(self._poll)
            records = [SourceRecord.from_message(m) for m in messages if self._usable(m)]
            if records:
                self._size_polls(records)
                await self._accept(records)
            await self._apply_pauses()
            now = asyncio.get_running_loop().time()
            if now >= next_flush:
                await self._flush_offsets()
                next_flush = now + _OFFSET_FLUSH_INTERVAL

    def _poll(self) -> list[Any]:
        """A batch as soon as one record is there (on the consumer thread): `consume(n, timeout)` alone waits for
        n records or the whole timeout, so at a few hundred records/s every record would wait ~100 ms. Wait for
        one, then take what else is fetched already."""
        assert self._consumer is not None
        first = self._consumer.consume(1, _POLL_TIMEOUT)
        if not first or self._poll_size <= 1:
            return first
        return first + self._consumer.consume(self._poll_size - 1, 0)

    def _size_polls(self, records: list[SourceRecord]) -> None:
        """One poll returns whatever librdkafka fetches within its timeout, past queued.max.messages.kbytes: with
        large records, ask for fewer at a time, so a poll brings at most a quarter of the backlog's budget."""
        average = sum(len(r.value) for r in records) / len(records)
        budget = self.config.kafka.max_buffered_mb * 1024 * 1024 / 2
        fits = int(budget / 4 / max(average, 1.0))
        self._poll_size = max(1, min(_BATCH, fits, self._poll_size * 4))

    def _usable(self, msg: Any) -> bool:
        error = msg.error()
        if error is None:
            return True
        if error.code() != KafkaError._PARTITION_EOF:
            log.warning("consumer error: %s", error)
        return False

    async def _accept(self, records: list[SourceRecord]) -> None:
        by_partition: dict[TP, list[SourceRecord]] = {}
        for record in records:
            tp = (record.topic, record.partition)
            by_partition.setdefault(tp, []).append(record)
        trackers = {}
        for tp, batch in by_partition.items():
            tracker = trackers[tp] = self._trackers.setdefault(tp, PartitionTracker())
            for record in batch:
                tracker.fetched(record.offset)
        self.stats["records"] += len(records)
        # Durable before any of these handlers runs: a handler that kills the process is recognised on return.
        # The journal write is not awaited here: the next poll overlaps it (it joins the failures' group commit),
        # and the batch starts once it is durable, after the batches fetched before it.
        ranges = [(t, p, _first(self._trackers[(t, p)].lowest_pending, batch[-1].offset), batch[-1].offset)
                  for (t, p), batch in by_partition.items()]
        while len(self._journaling) >= _JOURNALS_IN_FLIGHT:
            await asyncio.wait([self._journaling[0]])
        previous = self._journaling[-1] if self._journaling else None
        task = asyncio.create_task(self._journal_then_start(ranges, by_partition, previous, trackers),
                                   name="rdq-journal")
        self._journaling.append(task)
        task.add_done_callback(self._journaling.remove)

    async def _journal_then_start(self, ranges: list[tuple[str, int, int, int]],
                                  by_partition: dict[TP, list[SourceRecord]], previous: asyncio.Task[None] | None,
                                  trackers: dict[TP, PartitionTracker]) -> None:
        await self._journal(ranges)
        if previous is not None:
            await asyncio.wait([previous])  # fetch order
        for tp, batch in by_partition.items():
            if self._trackers.get(tp) is not trackers[tp]:
                continue  # revoked (or lost, and maybe assigned again) meanwhile: left uncommitted, fetched again
            lane = self._lane(tp)
            if not lane.keys_loaded and tp not in self._restoring:
                await self._load_keys(lane)  # while restoring: once restored (_restore_one), not before
            lane.add(batch)
            self._start_ready(tp)

    async def _load_keys(self, lane: Lane) -> None:
        """ordering: key — the partition's keys with an open task in the store block their records from the
        first one (tasks from before a restart, restored from the changelog, parked ones)."""
        delay = 0.05
        while True:
            try:
                keys = await self.store.order_open_keys(lane.tp[0], lane.tp[1], lane.queue_name)
                break
            except StoreError as e:
                log.error("cannot read the open keys of %s/%d (retrying): %s", *lane.tp, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        decoded = set()
        for order_key in keys:
            try:
                decoded.add(key_of_order_key(order_key))
            except ValueError as e:  # not made by this release: its task runs, later records of it are not held
                log.error("%s/%d: an ordering key that is not one: %s", *lane.tp, e)
        lane.load_keys(decoded)

    async def _refresh_keys(self) -> None:
        """ordering: key — blocked keys whose tasks all ended are unblocked (their records run inline again)."""
        while True:
            await asyncio.sleep(_KEYS_INTERVAL)
            for lane in [lane for lane in self._lanes.values() if lane.ordered and not lane.released]:
                blocked = lane.blocked_keys()
                if not blocked:
                    continue
                by_order_key = {order_key_of(lane.tp[0], lane.tp[1], key): key for key in blocked}
                try:
                    still = await self.store.order_open_of(list(by_order_key))  # type: ignore[arg-type]
                except StoreError:
                    continue
                lane.unblock({key: blocked[key] for order_key, key in by_order_key.items() if order_key not in still})

    def block_order_keys(self, order_keys: set[str]) -> None:
        """ordering: key — tasks of these keys are about to be redriven: the lanes of their partitions park the
        keys' new records behind them (a record already running ends first)."""
        for order_key in order_keys:
            try:
                topic, partition, key = parse_order_key(order_key)
            except ValueError:
                continue
            lane = self._lanes.get((topic, partition))
            if lane is not None and lane.ordered:
                lane.block(key)

    def _lane(self, tp: TP) -> Lane:
        lane = self._lanes.get(tp)
        if lane is None:
            queue = self.config.queue_for_topic(tp[0]) or ""
            lane = self._lanes[tp] = Lane(tp, queue, self.delivery, self.delivery.threads,
                                          self.config.kafka.partition_concurrency, self._on_results,
                                          functools.partial(self._is_suspect, tp), self._counted_failure,
                                          self._load)
        return lane

    async def _journal(self, ranges: list[tuple[str, int, int, int]]) -> None:
        committed = [(t, p, off) for (t, p), tr in self._trackers.items() if (off := tr.commit_offset()) is not None]
        delay = 0.05
        while True:
            try:
                await self.store.journal_inflight(self.run_id, ranges, committed, self.clock.now_ms())
                self.set_store_health(True)
                return
            except StoreError as e:
                log.error("cannot journal in-flight records (retrying; consumption paused): %s", e)
                self.set_store_health(False)
                await self._apply_pauses()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _start_ready(self, tp: TP) -> None:
        lane = self._lanes.get(tp)
        if lane is None:
            return
        self._hold_lanes({tp})
        lane.dispatch()

    def _hold_lanes(self, tps: Iterable[TP] | None = None) -> None:
        """Whether each lane may start records: not while the store cannot be written, the partition restores,
        or its queue is held (paused by an operator, at max_open_tasks). Fetched records wait too, not only the
        fetching; records already running finish."""
        held = self._held_queues()
        for tp in self._lanes if tps is None else tps:
            lane = self._lanes.get(tp)
            if lane is not None and not lane.released:
                lane.held = (not self._store_healthy or tp in self._restoring or not lane.keys_loaded
                             or lane.queue_name in held)

    def _on_results(self, lane: Lane, results: list[Ran]) -> None:
        """A lane's finished records: successes are done; failures are stored together (one group commit)."""
        current = self._lanes.get(lane.tp) is lane
        tracker = self._trackers.get(lane.tp) if current else None
        self.delivery.telemetry.metrics.records_seen(lane.queue_name, len(results))
        self.delivery.count(lane.queue_name, results)
        failures = []
        for ran in results:
            if ran.task is None:
                if tracker is not None:
                    tracker.done(ran.record.offset)
            else:
                failures.append(ran)
        if failures:
            storing = self._storing.setdefault(lane.tp, set())
            task = asyncio.create_task(self._store_failures(lane, failures), name="rdq-store-failures")
            storing.add(task)
            task.add_done_callback(storing.discard)

    async def _store_failures(self, lane: Lane, failures: list[Ran]) -> None:
        tp = lane.tp
        try:
            stored = await self.delivery.store_all([ran.task for ran in failures if ran.task is not None])
        except Exception:
            # Not done: keep the records pending (the commit cannot pass them) and run them again shortly.
            log.exception("storing failed first deliveries failed unexpectedly; retrying",
                          extra={"queue": lane.queue_name})
            lane.stored([ran.record.key for ran in failures])  # reported again when they run again
            await asyncio.sleep(1.0)
            if self._lanes.get(tp) is lane:
                lane.put_back([ran.record for ran in failures])
                self._start_ready(tp)
            return
        if lane.ordered:
            lane.stored([ran.record.key for ran in failures])
        for ran, task in zip(failures, stored, strict=True):
            if self.changelog is not None:
                # Stored here; its offset moves once its task is in the changelog.
                self.changelog.writer.when_logged(task.task_id, functools.partial(self._logged, tp, ran.record.offset))
            else:
                self._logged(tp, ran.record.offset)

    async def _watch_lanes(self) -> None:
        """One watchdog for every lane's running records (hung, silent or past queue_timeout: abandoned)."""
        while True:
            await asyncio.sleep(_WATCH_INTERVAL)
            now = time.monotonic()
            self._load.sample(now)
            for lane in list(self._lanes.values()):
                lane.watch(now)

    def _logged(self, tp: TP, offset: int) -> None:
        tracker = self._trackers.get(tp)
        if tracker is not None:
            tracker.done(offset)

    def _is_suspect(self, tp: TP, offset: int) -> bool:
        """Asked by the lane's runner for each record (on a handler thread for a sync handler)."""
        ranges = self._suspects.get(tp)
        if not ranges or not any(lo <= offset <= hi for lo, hi in ranges):
            return False
        self.stats["suspects"] += 1
        return True

    # ---- offsets -------------------------------------------------------------------------------------------

    def _commit_offsets(self, tps: set[TP] | None = None, only_new: bool = True) -> list[TopicPartition]:
        out = []
        for tp, tracker in self._trackers.items():
            if tps is not None and tp not in tps:
                continue
            offset = tracker.take_new_commit() if only_new else tracker.commit_offset()
            if offset is not None:
                out.append(TopicPartition(tp[0], tp[1], offset))
        return out

    async def _flush_offsets(self) -> None:
        if self.changelog is not None:
            return  # the changelog writer commits offsets, in its transactions
        offsets = [o for o in self._commit_offsets() if (o.topic, o.partition) in self._assigned]
        if not offsets or self._consumer is None:
            return
        try:
            await self._call(self._consumer.store_offsets, offsets=offsets)
        except KafkaException as e:
            log.warning("store_offsets failed (will retry): %s", e)
            for o in offsets:  # make the next flush try these again
                tracker = self._trackers.get((o.topic, o.partition))
                if tracker is not None:
                    tracker.forget_commit()

    # ---- pauses (SPEC §5.2, §5.4) -------------------------------------------------------------------------

    def _held_queues(self) -> set[str]:
        return self._backpressured | self._operator_paused()

    def _wanted_pauses(self) -> set[TP]:
        """Pause a partition only when its fetched-but-waiting records pile up past a high-water mark (and until
        they drain to half of it): pausing makes librdkafka drop what it prefetched, so it is kept for real
        pressure, not for every batch that outnumbers the partition's slots."""
        if not self._store_healthy:
            return set(self._assigned)
        held = self._held_queues()
        high = _BACKLOG_HIGH
        # The fetched backlog is bounded in bytes too (1 MB records must not take gigabytes): each partition's
        # share of the bridge's budget (librdkafka's own prefetch queue has the other half, see kafka_clients).
        high_bytes = self.config.kafka.max_buffered_mb * 1024 * 1024 / 2 / max(1, len(self._assigned))
        wanted = self._restoring & self._assigned
        for tp in self._assigned:
            lane = self._lanes.get(tp)
            waiting, size = (lane.backlog, lane.ready_bytes) if lane is not None else (0, 0)
            if (waiting > high or size > high_bytes
                    or (tp in self._paused and (waiting > high // 2 or size > high_bytes / 2))
                    or self.config.queue_for_topic(tp[0]) in held):
                wanted.add(tp)
        return wanted

    def backlog_bytes(self) -> int:
        """Payload bytes fetched and waiting for a runner, over all partitions."""
        return sum(lane.ready_bytes for lane in self._lanes.values())

    async def _apply_pauses(self) -> None:
        if self._consumer is None:
            return
        wanted = self._wanted_pauses()
        to_pause, to_resume = wanted - self._paused, (self._paused - wanted) & self._assigned
        if to_pause:
            await self._call(self._consumer.pause, [TopicPartition(t, p) for t, p in to_pause])
        if to_resume:
            await self._call(self._consumer.resume, [TopicPartition(t, p) for t, p in to_resume])
        self._paused = (self._paused | to_pause) - to_resume
        self._hold_lanes()
        held = self._held_queues()
        if self._was_held - held:
            self._start_all()  # a hold was lifted: records fetched meanwhile may start
        self._was_held = held

    def _counted_failure(self, lane: Lane, ran: Ran) -> None:
        """A first delivery failed into a PENDING task (not stored yet): count it open now, so a burst of failures
        is held at max_open_tasks, not a batch later. Called by the lane's runner — on a handler thread for a
        sync handler: it only counts and raises `held` flags (plain assignments); the rest runs on the loop."""
        if ran.task is None or ran.task.status != Status.PENDING:
            return
        name = lane.queue_name
        self._open_tasks[name] = open_tasks = self._open_tasks.get(name, 0) + 1
        queue = self.live.queue(name)
        if queue is not None and open_tasks >= queue.max_open_tasks:
            for other in list(self._lanes.values()):
                if other.queue_name == name:
                    other.held = True
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._check_backpressure, name, queue.max_open_tasks)

    def _check_backpressure(self, name: str, limit: int) -> None:
        if self._open_tasks.get(name, 0) >= limit and name not in self._backpressured:
            log.warning("queue at max_open_tasks (%d): pausing its sources", limit, extra={"queue": name})
            self._backpressured.add(name)
            self._hold_lanes()

    async def _watch_backpressure(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for name in self.live.queue_names():
                queue = self.live.queue(name)
                if queue is None:
                    continue
                try:
                    open_tasks = self._open_tasks[name] = await self.store.count_open(name)
                except StoreError:
                    continue
                self._check_backpressure(name, queue.max_open_tasks)
                if open_tasks < queue.max_open_tasks * _RESUME_FRACTION and name in self._backpressured:
                    log.info("queue drained below max_open_tasks: resuming its sources", extra={"queue": name})
                    self._backpressured.discard(name)
                    self._start_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _BACKPRESSURE_INTERVAL)

    # ---- rebalances (called on the consumer thread, inside consume) ---------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        assert self._loop is not None
        self._metadata = consumer.consumer_group_metadata()  # every rebalance is a new generation
        self._writable = self._writable | tps
        if self.changelog is not None:
            self._restoring |= tps  # set here, on the consumer thread: no record of theirs starts before restored
            for tp in tps:
                self._epochs[tp] = self._epochs.get(tp, 0) + 1
            epochs = {tp: self._epochs[tp] for tp in tps}
            losing = [f for tp in tps if (f := self._losing.get(tp)) is not None and not f.done()]
            self._loop.call_soon_threadsafe(self._start_restore, tps, losing, epochs)
        self._loop.call_soon_threadsafe(self._assigned.update, tps)
        log.info("assigned %s", sorted(f"{t}/{p}" for t, p in tps))

    # ---- restore (SPEC §10) --------------------------------------------------------------------------------

    def _start_restore(self, tps: set[TP], losing: list[concurrent.futures.Future[None]],
                       epochs: dict[TP, int]) -> None:
        task = asyncio.create_task(self._restore_all(tps, losing, epochs), name="rdq-restore")
        self._restores.add(task)
        task.add_done_callback(self._restores.discard)

    def _restoring_now(self, epochs: dict[TP, int]) -> Callable[[TP], bool]:
        """Is this partition still restoring for the assignment these epochs are of?"""
        return lambda tp: tp in self._restoring and self._epochs.get(tp) == epochs.get(tp)

    async def _restore_all(self, tps: set[TP], losing: Sequence[concurrent.futures.Future[None]],
                           epochs: dict[TP, int]) -> None:
        """The assignment's partitions restore at once (one consumer); each is ready as soon as its own restore
        ends. One that failed (the broker away, its changelog topic not there yet) is retried alone, with a
        backoff. A partition lost and assigned again at once (a static member back within its session): its
        restore waits for the lost one's clean-up, which drops what this file held of it."""
        assert self.changelog is not None
        for future in losing:
            with contextlib.suppress(Exception):  # _lose logs its own failures
                await asyncio.wrap_future(future)
        metrics = self.changelog.telemetry.metrics
        for tp in tps:
            metrics.restoring.labels(f"{tp[0]}/{tp[1]}").set(1)
        # The source offsets, asked once for the whole assignment while its changelogs are read.
        starts = asyncio.ensure_future(self._start_offsets(tps))
        current = self._restoring_now(epochs)
        failed = await self.changelog.restorer.restore_many(
            sorted(tps), current, functools.partial(self._restored_one, starts=starts, current=current))
        for tp in sorted(failed):
            if current(tp):
                log.error("cannot restore %s/%d yet (it stays unready and unconsumed; retrying): %s", *tp, failed[tp])
                await self._restore_one(tp, current)
        await self._drop_strangers()

    async def _restore_one(self, tp: TP, current: Callable[[TP], bool]) -> None:
        """One partition's restore, again and again (with a backoff) until it succeeds or the partition goes."""
        assert self.changelog is not None
        delay = 0.5
        while current(tp):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
            try:
                report = await self.changelog.restorer.restore(tp, wanted=lambda: current(tp))
                await self._restored_one(report, current=current)
                return
            except (RestoreFailed, KafkaException, StoreError) as e:
                if not current(tp):
                    return
                if tp[0] not in self.changelog.restorer.topics and self.changelog.ensure_topics is not None:
                    with contextlib.suppress(Exception):  # the topic's check says why, in the next log line
                        await self.changelog.ensure_topics()
                    if tp[0] in self.changelog.restorer.topics:
                        delay = 0.0
                        continue
                log.error("cannot restore %s/%d yet (it stays unready and unconsumed; retrying): %s", *tp, e)

    async def _restored_one(self, report: RestoreReport, current: Callable[[TP], bool],
                            starts: asyncio.Future[dict[TP, int | None]] | None = None) -> None:
        """A partition's tasks are in the store: its source offset known, its keys read, it runs. `starts`: the
        assignment's source offsets, being asked (else, or if that failed, asked for this partition now)."""
        assert self.changelog is not None and self._consumer is not None
        tp = report.home
        if not current(tp):
            return  # revoked (or lost) while restoring
        known: dict[TP, int | None] = {}
        if starts is not None:
            with contextlib.suppress(KafkaException):
                known = await starts
        offset = known[tp] if tp in known else (await self._start_offsets({tp}))[tp]
        if not current(tp):
            return
        if offset is not None:
            self._baseline[tp] = offset
        await self.changelog.local.set_home(tp, "active")
        lane = self._lanes.get(tp)
        if lane is not None and not lane.keys_loaded:
            await self._load_keys(lane)  # the restored tasks' keys: read now, not when the first records came
        if not current(tp):
            return
        self._restoring.discard(tp)
        label = f"{tp[0]}/{tp[1]}"
        metrics = self.changelog.telemetry.metrics
        metrics.restoring.labels(label).set(0)
        metrics.restored_tasks.labels(label).set(report.tasks)
        metrics.restore_seconds.labels(label).set(report.seconds)
        self._restored[tp] = {"restored_tasks": report.tasks, "restore_seconds": round(report.seconds, 3),
                              "unreadable": report.unreadable}
        if report.unreadable:
            await self.changelog_status()  # the unreadable gauge, now
        log.info("restored %s: %d tasks from %d changelog records in %.2fs (%d tombstones, %d unreadable, "
                 "%d local tasks the changelog no longer holds dropped)", label, report.tasks, report.records,
                 report.seconds, report.tombstones, report.unreadable, report.dropped)
        self._start_ready(tp)

    async def _start_offsets(self, tps: set[TP]) -> dict[TP, int | None]:
        """Each partition's committed offset, one request for them all. A partition with none (nothing consumed
        yet) still needs one in the changelog writer's transactions: its offsets are what fences a zombie's writes,
        and without any, a round holding an import or a redrive homed here was refused for ever. The offset the
        consumer would start from anyway (earliest, or latest when the config says so) is taken: it changes
        nothing of what is consumed. None: not known (the broker did not answer); its writes wait for a first
        record. Raises KafkaException when the committed offsets cannot be read."""
        assert self._consumer is not None
        committed = await self._call(self._consumer.committed, [TopicPartition(*tp) for tp in sorted(tps)], 10.0)
        offsets: dict[TP, int | None] = {(p.topic, p.partition): p.offset for p in committed if p.offset >= 0}
        missing = sorted(tps - offsets.keys())
        if missing:
            policy = str(self.config.kafka.consumer.get("auto.offset.reset", "earliest"))
            # offsets_for_times with OFFSET_END / OFFSET_BEGINNING as the time: the latest / earliest offsets of
            # all of them in one ListOffsets request.
            start = OFFSET_END if policy in ("latest", "largest", "end") else OFFSET_BEGINNING
            try:
                found = await self._call(self._consumer.offsets_for_times,
                                         [TopicPartition(*tp, start) for tp in missing], 10.0)
            except KafkaException as e:
                log.warning("%s: no committed offset and no watermarks (%s): their writes wait for a first record",
                            ", ".join(f"{t}/{p}" for t, p in missing), e)
                found = []
            for p in found:
                if p.error is None and p.offset >= 0:
                    offsets[(p.topic, p.partition)] = p.offset
        return {tp: offsets.get(tp) for tp in tps}

    async def _drop_strangers(self) -> None:
        """Tasks in this file whose partition is not this instance's (left by a crash, or by a run before the
        group moved it): the owner restores them from the changelog; kept here they would only mislead."""
        assert self.changelog is not None
        for home in await self.changelog.local.homes_present() - self._assigned - self._restoring:
            if home[0] in self.changelog.restorer.topics:
                dropped = await self.changelog.local.drop_home(home)
                log.info("dropped %d tasks of %s/%d: another instance owns that partition", dropped, *home)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        assert self._loop is not None
        self._metadata = consumer.consumer_group_metadata()  # the generation that revokes them: still ours
        future = asyncio.run_coroutine_threadsafe(self._release(tps), self._loop)
        try:
            offsets = future.result(self.grace_period + _FLUSH_TIMEOUT + 5)
        except Exception:
            log.exception("could not drain revoked partitions; their uncommitted records will be redelivered")
            return
        finally:
            self._writable = self._writable - tps
        if offsets and self.changelog is None:
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as e:
                log.warning("commit on revoke failed (records will be redelivered): %s", e)
        log.info("revoked %s", sorted(f"{t}/{p}" for t, p in tps))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        assert self._loop is not None
        # At once, on this thread: the writer must not write a lost partition's tasks or offsets, not even in a
        # round already under way (it filters with these at produce time), before _lose has dropped them.
        self._writable = self._writable - tps
        self._metadata = None
        # Here too, on this thread, before an assignment of the same partitions that may follow at once (a static
        # member back within its session): that one sets them restoring again, and must find them forgotten —
        # not forgotten after it, when a late clean-up wiped the new assignment's state and left them unowned.
        self._restoring -= tps
        self._loop.call_soon_threadsafe(self._forget_state, tps)
        future = asyncio.run_coroutine_threadsafe(self._lose(tps), self._loop)
        for tp in tps:
            self._losing[tp] = future
        log.warning("partitions lost %s: their uncommitted records will be redelivered", sorted(tps))

    async def _release(self, tps: set[TP]) -> list[TopicPartition]:
        """Finish the revoked partitions' running records (within the grace period) and say what to commit.

        Records not started are dropped here: they stay uncommitted, so the next owner gets them.
        """
        tps &= self._assigned  # after a stop's own hand-over, the revoke inside close() has nothing left to do
        if not tps:
            return []
        lanes = [lane for tp in tps if (lane := self._lanes.get(tp)) is not None]
        for lane in lanes:
            lane.let_go()  # records not started stay uncommitted: the next owner gets them
        restoring = tps & self._restoring
        self._restoring -= tps
        if self.changelog is not None:
            for tp in tps - restoring:
                await self._changelog_call(self.changelog.local.set_home(tp, "leaving"))
        began = time.monotonic()
        late = await self._drain_lanes(lanes, tps, self.grace_period)
        if late:
            log.warning("%d records still running after the grace period; they may run twice", late)
        if self.changelog is not None:
            # One grace period for the first deliveries and the retries together.
            await self._hand_over(tps - restoring, max(0.0, self.grace_period - (time.monotonic() - began)))
            for tp in restoring:  # what a restore cut short put in this file: the changelog has it all
                await self._changelog_call(self.changelog.local.drop_home(tp))
        offsets = self._commit_offsets(tps, only_new=False)
        await self._forget(tps)
        return offsets

    async def _drain_lanes(self, lanes: list[Lane], tps: set[TP], within: float) -> int:
        """Wait (up to `within` seconds) for these lanes' running records and the storing of their failures.
        Returns how many records were still running."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            storing = [t for tp in tps for t in self._storing.get(tp, ())]
            if not any(lane.busy for lane in lanes) and not storing:
                return 0
            await asyncio.sleep(0.01)
        storing = [t for tp in tps for t in self._storing.get(tp, ())]
        if storing:  # stores retry until durable: a record whose handler ended is never given up here
            await asyncio.wait(storing, timeout=5.0)
        return sum(lane.running() for lane in lanes)

    async def _stop_restores(self) -> None:
        for task in list(self._restores):
            task.cancel()
        if self._restores:
            await asyncio.wait(list(self._restores), timeout=5.0)

    async def _serve_rebalance_until_flushed(self, tries: int = 10) -> None:
        """A stop that lands in a rebalance (another instance just left): the group moved to a new generation
        this instance has not joined, so its transactions are refused as stale. Take part in the rebalance (its
        callbacks hand over what moves and refresh the generation) without handling what it fetches — those
        records stay uncommitted for their next owner — until a flush commits."""
        assert self.changelog is not None and self._consumer is not None
        for _ in range(tries):
            if not self._assigned or await self.changelog.writer.flush():
                return
            log.info("stopping during a rebalance: joining it before the last changelog flush")
            await self._call(self._consumer.consume, 100, 0.5)  # rebalance callbacks run in here

    async def _hand_over(self, tps: set[TP], grace: float) -> None:
        """Revoked partitions' tasks: running attempts finish (or are released), the changelog is flushed with
        the final offsets, then this file lets the tasks go: the next owner restores them."""
        assert self.changelog is not None
        began = time.monotonic()
        await self.changelog.hand_over(tps, grace)
        handed = time.monotonic()
        flushed = await self.changelog.writer.flush()
        log.info("hand-over of %s: running attempts %.2fs, changelog flush %.2fs (%s)",
                 sorted(f"{t}/{p}" for t, p in tps), handed - began, time.monotonic() - handed,
                 "committed" if flushed else "NOT committed")
        for tp in tps:
            if flushed:
                dropped = await self._changelog_call(self.changelog.local.drop_home(tp))
                log.info("handed over %s/%d: %s tasks flushed to the changelog and dropped here", *tp, dropped)
            else:
                # Kept (not acted on): the next start's restore sorts it out; the changelog stays the truth.
                await self._changelog_call(self.changelog.local.set_home(tp, None))
                log.warning("handed over %s/%d without a final changelog flush: transitions since the last "
                            "transaction are lost to the next owner (their attempts run again)", *tp)

    @staticmethod
    async def _changelog_call(call: Any) -> Any:
        try:
            return await call
        except StoreError as e:
            log.error("store error while handing over a partition: %s", e)
            return None

    async def _lose(self, tps: set[TP]) -> None:
        """Partitions lost (this instance was out of the group): another owns them already; whatever this file
        holds of theirs that the changelog does not is lost to it (those attempts run again there). What this
        process knew of them is forgotten already (`_forget_state`, scheduled by `_on_lost`)."""
        try:
            if self.changelog is not None:
                for tp in tps:
                    await self._changelog_call(self.changelog.local.set_home(tp, None))
                await self.changelog.hand_over(tps, 0.0)
                for tp in tps:
                    await self._changelog_call(self.changelog.local.drop_home(tp))
            # Not the journal of a partition assigned again meanwhile: its new records may be journaled already
            # (the rows of the lost assignment stay with them: suspects at worst, pruned at the next revoke).
            await self._forget_journal(tps - self._restoring - self._assigned)
        finally:
            for tp in tps:
                if (future := self._losing.get(tp)) is not None and future.done():
                    del self._losing[tp]

    async def _forget(self, tps: set[TP]) -> None:
        self._restoring -= tps
        self._forget_state(tps)
        await self._forget_journal(tps)

    def _forget_state(self, tps: set[TP]) -> None:
        """What this process holds of these partitions, in memory: dropped (their records not started stay
        uncommitted for the next owner)."""
        for tp in tps:
            self._baseline.pop(tp, None)
            self._trackers.pop(tp, None)
            lane = self._lanes.pop(tp, None)
            if lane is not None:
                lane.let_go()
            self._storing.pop(tp, None)
            self._suspects.pop(tp, None)
        self._assigned -= tps
        self._paused -= tps

    async def _forget_journal(self, tps: set[TP]) -> None:
        # The journal's rows for these partitions (this run's and earlier runs') mark suspects only for this
        # instance; the next owner starts from the committed offset without them. Kept, they would only grow.
        try:
            await self.store.journal_forget_partitions(sorted(tps))
        except StoreError as e:
            log.warning("could not prune the journal of revoked partitions (retried at the next revoke): %s", e)

    # ---- graceful stop (SPEC §4.9) -----------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Stop consuming; let running first deliveries finish within the grace period; commit; close."""
        if self._journaling:
            await asyncio.wait(list(self._journaling), timeout=self.grace_period)
        lanes = list(self._lanes.values())
        for lane in lanes:
            lane.let_go()
        late = await self._drain_lanes(lanes, set(self._lanes), self.grace_period)
        await self._stop_restores()
        if self.changelog is not None and self._consumer is not None and self._assigned:
            # Hand everything over while the group is stable, as Kafka Streams commits before closing its
            # consumer: inside close() the group is already rebalancing and a transaction's offsets wait for it.
            await self._serve_rebalance_until_flushed()
            await self._stop_restores()  # the rebalance may have assigned more: not restored, handed back
            await self._release(set(self._assigned))
        if self._consumer is not None:
            offsets = self._commit_offsets(only_new=False)
            with contextlib.suppress(KafkaException):
                if offsets and self.changelog is None:
                    await self._call(self._consumer.commit, offsets=offsets, asynchronous=False)
            await self._call(self._consumer.close)  # revokes (our callback commits again) and leaves the group
        if not late:  # everything handed to a handler finished: this run's journal has nothing to say
            with contextlib.suppress(StoreError):
                await self.store.journal_forget_run(self.run_id)
        self._thread.shutdown(wait=False)
