"""The source consumer (SPEC §4.1, §4.10, §5.1, §5.2, §5.4): at-least-once, concurrent within a partition.

- Every confluent-kafka call runs on one dedicated thread; rebalance callbacks run there too (inside consume).
- A record's offset is stored for commit only once it is done (succeeded or its task durably stored), and never
  past a record that is not: the commit is the highest contiguous done offset of each partition.
- Before a batch's handlers start, each partition's in-flight offset range is journaled (journal.py).
- Which partitions are this instance's, their restore and hand-over: ownership.py; one state object per
  assigned partition: partitions.py; when a partition pauses and a lane may start: backpressure.py.

This module is the poll loop: fetch, journal, hand each partition's records to its lane, take the lanes' results
(successes done, failures stored together), move the offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException

from bridge.aio import OneThread
from bridge.clock import Clock
from bridge.config import BridgeConfig
from bridge.live_config import LiveConfig
from bridge.records import TP, Fetched
from bridge.source.backpressure import Backpressure
from bridge.source.ends import Ran, Results
from bridge.source.first_delivery import FirstDelivery
from bridge.source.journal import InflightJournal
from bridge.source.keys import OrderKeys
from bridge.source.lanes import Lane
from bridge.source.ownership import Ownership, offsets_to_commit
from bridge.source.partitions import Partitions, PartitionState, Phase
from bridge.source.restores import Changelog
from bridge.source.runners import CpuLoad
from bridge.store.tasks import Store

log = logging.getLogger(__name__)
# Records asked of one poll at most. Each poll costs a journal write (one group commit), a hop to the consumer
# thread and back and a task: polls of 2,000 ran the happy path 7 % faster (bench_kafka happy, alternated), but a
# poll's in-flight range is what a crash turns into suspects (LEASE_EXPIRED attempts, records never started among
# them): under poison pills the nemesis took 145-165 s against 107-108 and dead-lettered 59 `pay` records
# against 0 (seeds 13, 14, alternated). Kept at 500. The byte budget (`next_poll_size`) caps it for large records.
_BATCH = 500
_FIRST_POLL = 4
_POLL_TIMEOUT = 0.1
_OFFSET_FLUSH_INTERVAL = 0.2
_JOURNALS_IN_FLIGHT = 4  # fetched batches waiting for their journal write before the poll waits too
_WATCH_INTERVAL = 0.05  # how late past its lease a hung first delivery may be noticed


def next_poll_size(current: int, average_bytes: float, max_buffered_mb: float) -> int:
    """How many records the next poll asks for: four times the last, up to `_BATCH`. One poll returns whatever
    librdkafka fetched, past queued.max.messages.kbytes: with large records (`average_bytes` of the last poll's),
    fewer at a time, so a poll brings at most a quarter of the backlog's budget (half of max_buffered_mb)."""
    budget = max_buffered_mb * 1024 * 1024 / 2
    fits = int(budget / 4 / max(average_bytes, 1.0))
    return max(1, min(_BATCH, fits, current * 4))


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
        self.clock = clock
        self.grace_period = grace_period
        self.changelog = changelog
        self._consumer_factory = consumer_factory
        self.kafka: Consumer | None = None
        self.thread = OneThread("rdq-kafka-consumer")
        self.partitions = Partitions()
        self.journal = InflightJournal(store, run_id, clock)
        self.keys = OrderKeys(store, self.partitions)
        self.backpressure = Backpressure(config, live, store, self.partitions, paused_queues)
        self.ownership = Ownership(config, self.partitions, self.backpressure, self.keys, self.journal,
                                   self.thread, lambda: self.kafka, grace_period, changelog)
        self._journaling: deque[asyncio.Task[None]] = deque()  # fetched batches whose journal write is pending
        self._orphans: set[asyncio.Task[None]] = set()  # failures being stored of a lane no longer current
        # Records asked of one poll: a few at first, more as their sizes show the budget allows (_size_polls).
        self._poll_size = _FIRST_POLL
        self._load = CpuLoad()  # more runners for slow handlers only while the process is not computing flat out
        self._records = 0

    # ---- what others ask -----------------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        return {"records": self._records, "suspects": self.journal.suspects_seen}

    @property
    def assigned(self) -> set[TP]:
        return self.partitions.tps()

    @property
    def lanes(self) -> dict[TP, Lane]:
        return {s.tp: s.lane for s in self.partitions if s.lane is not None}

    @property
    def paused(self) -> set[TP]:
        """Partitions paused in librdkafka now."""
        return {s.tp for s in self.partitions if s.paused}

    @property
    def restoring(self) -> set[TP]:
        return self.partitions.tps(Phase.RESTORING)

    @property
    def joined(self) -> bool:
        """The consumer group gave this instance its first assignment (maybe of no partition)."""
        return self.ownership.joined

    def owns(self, topic: str, partition: int) -> bool:
        return self.ownership.owns(topic, partition)

    async def changelog_status(self) -> dict[str, Any]:
        return await self.ownership.restores.changelog_status()

    def group_metadata(self) -> Any | None:
        return self.ownership.group_metadata()

    def writable(self) -> frozenset[TP]:
        return self.ownership.writable()

    def commit_positions(self) -> dict[TP, int]:
        return self.ownership.commit_positions()

    @property
    def store_healthy(self) -> bool:
        return self.backpressure.store_healthy

    def set_store_health(self, healthy: bool) -> None:
        self.backpressure.set_store_health(healthy)

    def block_order_keys(self, order_keys: set[str]) -> None:
        self.keys.block(order_keys)

    def backlog_bytes(self) -> int:
        return self.backpressure.backlog_bytes()

    # ---- the loop ------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        self.backpressure.bind(loop)
        self.ownership.bind(loop)
        await self.journal.load()
        self.kafka = await self.thread.call(self._consumer_factory)
        topics = [t for q in self.config.queues.values() for t in q.sources]
        await self.thread.call(self.kafka.subscribe, topics, on_assign=self.ownership.on_assign,
                               on_revoke=self.ownership.on_revoke, on_lost=self.ownership.on_lost)
        side = [asyncio.create_task(self.backpressure.watch(stop), name="rdq-backpressure"),
                asyncio.create_task(self._watch_lanes(), name="rdq-lanes-watch"),
                asyncio.create_task(self.keys.refresh(), name="rdq-order-keys")]
        try:
            await self._consume_until(stop)
        finally:
            side[0].cancel()
            try:
                await self._shutdown()
            finally:
                for task in side[1:]:
                    task.cancel()

    async def _consume_until(self, stop: asyncio.Event) -> None:
        next_flush = 0.0
        while not stop.is_set():
            messages = await self.thread.call(self._poll)
            records: list[Fetched] = [m for m in messages if m.error() is None]  # as fetched (records.py)
            if len(records) != len(messages):
                self._log_errors(messages)
            if records:
                self._size_polls(records)
                await self._accept(records)
            await self.backpressure.apply(self.kafka, self.thread)
            now = asyncio.get_running_loop().time()
            if now >= next_flush:
                await self._flush_offsets()
                next_flush = now + _OFFSET_FLUSH_INTERVAL

    def _poll(self) -> list[Any]:
        """A batch as soon as one record is there (on the consumer thread): `consume(n, timeout)` alone waits for
        n records or the whole timeout, so at a few hundred records/s every record would wait ~100 ms. What is
        fetched already is taken in one call; only when nothing is, wait for one, then take what else came.
        One call, not two, while records flow: each call gives the GIL up and waits to take it back from the
        handler threads (~1-2 ms a poll under load)."""
        assert self.kafka is not None
        fetched = self.kafka.consume(self._poll_size, 0)
        if fetched:
            return fetched
        first = self.kafka.consume(1, _POLL_TIMEOUT)
        if not first or self._poll_size <= 1:
            return first
        return first + self.kafka.consume(self._poll_size - 1, 0)

    def _size_polls(self, records: list[Fetched]) -> None:
        average = sum([len(r) for r in records]) / len(records)
        self._poll_size = next_poll_size(self._poll_size, average, self.config.kafka.max_buffered_mb)

    @staticmethod
    def _log_errors(messages: list[Any]) -> None:
        """A poll's error events (not records): logged, except the end of a partition."""
        for msg in messages:
            error = msg.error()
            if error is not None and error.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", error)

    async def _accept(self, records: list[Fetched]) -> None:
        by_tp: dict[TP, list[Fetched]] = {}
        for record in records:
            tp = (record.topic(), record.partition())
            batch = by_tp.get(tp)
            if batch is None:
                batch = by_tp[tp] = []
            batch.append(record)
        # A record fetched before its partition was revoked is left out: uncommitted, its next owner gets it.
        by_partition = {state: batch for tp, batch in by_tp.items() if (state := self.partitions.get(tp)) is not None}
        for state, batch in by_partition.items():
            state.tracker.fetched_many([record.offset() for record in batch])
        self._records += len(records)
        # Durable before any of these handlers runs: a handler that kills the process is recognised on return.
        # The journal write is not awaited here: the next poll overlaps it (it joins the failures' group commit),
        # and the batch starts once it is durable, after the batches fetched before it.
        ranges = [(*state.tp, _first(state.tracker.lowest_pending, batch[-1].offset()), batch[-1].offset())
                  for state, batch in by_partition.items()]
        while len(self._journaling) >= _JOURNALS_IN_FLIGHT:
            await asyncio.wait([self._journaling[0]])
        previous = self._journaling[-1] if self._journaling else None
        task = asyncio.create_task(self._journal_then_start(ranges, by_partition, previous), name="rdq-journal")
        self._journaling.append(task)
        task.add_done_callback(self._journaling.remove)

    async def _journal_then_start(self, ranges: list[tuple[str, int, int, int]],
                                  by_partition: dict[PartitionState, list[Fetched]],
                                  previous: asyncio.Task[None] | None) -> None:
        committed = [(*s.tp, off) for s in self.partitions if (off := s.tracker.commit_offset()) is not None]
        await self.journal.write(ranges, committed, self.backpressure.set_store_health, self._apply_pauses)
        if previous is not None:
            await asyncio.wait([previous])  # fetch order
        for state, batch in by_partition.items():
            if not self.partitions.is_current(state) or state.phase not in (Phase.RESTORING, Phase.ACTIVE):
                continue  # revoked (or lost, and maybe assigned again) meanwhile: left uncommitted, fetched again
            lane = self._lane(state)
            if not lane.keys_loaded and state.phase is Phase.ACTIVE:
                await self.keys.load(lane)  # while restoring: once restored (Ownership._restored_one), not before
            lane.add(batch)
            self.backpressure.start(state)

    async def _apply_pauses(self) -> None:
        await self.backpressure.apply(self.kafka, self.thread)

    def _lane(self, state: PartitionState) -> Lane:
        if state.lane is None:
            tp = state.tp
            queue = self.config.queue_for_topic(tp[0]) or ""
            state.lane = Lane(tp, queue, self.delivery, self.delivery.threads,
                              self.config.kafka.partition_concurrency, self._on_results,
                              functools.partial(self.journal.is_suspect, tp), self.backpressure.counted_failure,
                              self._load)
        return state.lane

    # ---- the lanes' results --------------------------------------------------------------------------------

    def _on_results(self, lane: Lane, results: Results) -> None:
        """A lane's finished records: successes are done; failures are stored together (one group commit)."""
        state = self.partitions.get(lane.tp)
        current = state if state is not None and state.lane is lane else None
        self.delivery.telemetry.metrics.records_seen(lane.queue_name, len(results))
        self.delivery.count(lane.queue_name, results)
        if current is not None:
            current.tracker.done_many(results.done_offsets())
        failures = results.failures() if results.ran else []
        if failures:
            storing = current.storing if current is not None else self._orphans
            task = asyncio.create_task(self._store_failures(lane, current, failures), name="rdq-store-failures")
            storing.add(task)
            task.add_done_callback(storing.discard)

    async def _store_failures(self, lane: Lane, state: PartitionState | None, failures: list[Ran]) -> None:
        try:
            written_since = time.monotonic()  # before any round could read them: none waits to be asked about
            stored = await self.delivery.store_all([ran.task for ran in failures if ran.task is not None])
        except Exception:
            # Not done: keep the records pending (the commit cannot pass them) and run them again shortly.
            log.exception("storing failed first deliveries failed unexpectedly; retrying",
                          extra={"queue": lane.queue_name})
            lane.stored([ran.record.key for ran in failures])  # reported again when they run again
            await asyncio.sleep(1.0)
            if state is not None and self.partitions.is_current(state) and state.lane is lane:
                lane.put_back([ran.record for ran in failures])
                self.backpressure.start(state)
            return
        if lane.ordered:
            lane.stored([ran.record.key for ran in failures])
        for ran, task in zip(failures, stored, strict=True):
            if self.changelog is not None:  # stored here; its offset moves once its task is in the changelog
                logged = functools.partial(self.partitions.done, state, ran.record.offset)
                self.changelog.writer.when_logged(task.task_id, logged, written_since)
            else:
                self.partitions.done(state, ran.record.offset)

    async def _watch_lanes(self) -> None:
        """One watchdog for every lane's running records (hung, silent or past queue_timeout: abandoned)."""
        while True:
            await asyncio.sleep(_WATCH_INTERVAL)
            now = time.monotonic()
            self._load.sample(now)
            for lane in self.partitions.lanes():
                lane.watch(now)

    # ---- offsets -------------------------------------------------------------------------------------------

    async def _flush_offsets(self) -> None:
        if self.changelog is not None:
            return  # the changelog writer commits offsets, in its transactions
        states = list(self.partitions)
        offsets = offsets_to_commit(states)
        if not offsets or self.kafka is None:
            return
        try:
            await self.thread.call(self.kafka.store_offsets, offsets=offsets)
        except KafkaException as e:
            log.warning("store_offsets failed (will retry): %s", e)
            for o in offsets:  # make the next flush try these again
                if (state := self.partitions.get((o.topic, o.partition))) is not None:
                    state.tracker.forget_commit()

    # ---- graceful stop (SPEC §4.9) -----------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Stop consuming; let running first deliveries finish within the grace period; commit; close."""
        if self._journaling:
            await asyncio.wait(list(self._journaling), timeout=self.grace_period)
        states = list(self.partitions)
        for lane in self.partitions.lanes():
            lane.let_go()
        late = await self.ownership.drain(states, self.grace_period)
        if self._orphans:
            await asyncio.wait(list(self._orphans), timeout=5.0)
        await self.ownership.restores.stop()
        if self.changelog is not None and self.kafka is not None and len(self.partitions):
            # Hand everything over while the group is stable, as Kafka Streams commits before closing its
            # consumer: inside close() the group is already rebalancing and a transaction's offsets wait for it.
            await self.ownership.serve_rebalance_until_flushed()
            await self.ownership.restores.stop()  # the rebalance may have assigned more: not restored, handed back
            await self.ownership.release(self.partitions.tps())
        if self.kafka is not None:
            offsets = offsets_to_commit(list(self.partitions), only_new=False)
            with contextlib.suppress(KafkaException):
                if offsets and self.changelog is None:
                    await self.thread.call(self.kafka.commit, offsets=offsets, asynchronous=False)
            await self.thread.call(self.kafka.close)  # revokes (our callback commits again) and leaves the group
        if not late:  # everything handed to a handler finished: this run's journal has nothing to say
            await self.journal.forget_run()
        self.thread.shutdown(wait=False)
