"""Assign → restore → run (SPEC §10): a source partition's tasks are read from its changelog partition into SQLite
before any of them runs and before the partition is consumed.

An assignment's partitions restore at once, through one consumer (as Kafka Streams' `StoreChangelogReader` does):
one state object per changelog partition (`_Restoring`), and each partition made ready as soon as its own end is
reached, not after the others. The restore reads with `isolation.level=read_committed` (aborted writes of a zombie
or of a crashed owner are skipped) up to the high watermark seen when it began; it knows it reached it by the
consumer's position, which steps over the commit marker a transactional changelog ends with (no waiting for a
poll to come back empty). An open transaction of a crashed owner holds the end until the broker aborts it
(`transaction.timeout.ms`). The changelog wins over the local file; tasks the changelog never saw stay and are
logged (see LocalIndex.restore_finish).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from bridge.aio import OneThread
from bridge.changelog.decoder import PROCESS_FROM, Decoder
from bridge.changelog.fetched import Changelog, Fetched
from bridge.changelog.local import Home, LocalIndex, RestoreBatch
from bridge.changelog.picking import Picked, pick_last
from bridge.clock import Clock
from bridge.memory import give_back_freed_memory
from bridge.store.database import StoreError

log = logging.getLogger(__name__)
# Records a consume returns at most: what is in flight is two batches (one applied, the next read and decoded) and
# their copies on the way to the decoding process and back. With the restore consumer's 1 MiB fetches (kafka_clients)
# 1,000 a batch restored at the rate of 5,000 and peaked at 140 MiB against 331 (200k tasks, 12 partitions).
_BATCH = 1000
# Batches read and decoding while the store applies one. With one, the read and the decoding's round trip to its
# process took longer than the apply (100k tasks: waiting 2.2-2.5 s of 6.7); with two they overlap each other too
# (20.5-22.8k against 15.0-16.7k tasks/s, alternated); with three the apply slowed (more threads for the GIL).
_READ_AHEAD = 2
_POLL = 0.05  # a consume returns at _BATCH records or after this: a small partition waits no longer than it
_SLICE = 0.005  # within _POLL, how often a fetch looks whether every partition it reads is at its end
_STALL_WARN = 10.0
_PROBE_WITHIN = 10.0  # seconds to read past a stalled partition's markers before it is asked again
# Records decoded between two GIL releases (pick_last), for the store's thread to take the GIL back after each SQLite
# step. 10 was best on 2026-12-02 (one process, 8k tasks/s). Today's restore decodes on its restore thread under
# `processes: 2` (no core to spare for a decoding process), and that thread spent half its time in the yields
# (py-spy). 1M tasks over 12 partitions, alternated: every 10 records 42.9-46.8k tasks/s (median 45.8k), every 40
# 45.8-51.5k (median 48.7k); 25, 60 and 100 as good as 40 within the drift, never (0) as bad as 10 (bench/RESULTS.md,
# diagnostic, 2026-12-06 20:50-21:21 UTC).
_YIELD_EVERY = 40


@dataclass(frozen=True)
class RestoreReport:
    home: Home
    tasks: int
    tombstones: int
    unreadable: int
    dropped: int
    seconds: float
    records: int


class RestoreFailed(RuntimeError):
    """The changelog could not be read (broker unreachable): the partition stays unready, retried."""


@dataclass
class _Restoring:
    """One changelog partition being restored: its end (the high watermark when the restore began), how far it
    was read, and its figures. The tasks it found are the store's to know (`LocalIndex.restore_begin`): nothing
    here grows with the partition."""

    home: Home
    topic: str
    start: int = 0  # the log start offset when the restore began (the low watermark)
    end: int = 0
    empty: bool = True
    reached: int = -1
    done: bool = False  # finished (restored or given up)
    tasks: int = 0
    tombstones: int = 0
    unreadable: int = 0
    records: int = 0
    began: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)

    @property
    def partition(self) -> Changelog:
        return self.topic, self.home[1]

    def count(self, applied: RestoreBatch, records: int) -> None:
        self.tasks += applied.applied
        self.tombstones += applied.tombstones
        self.unreadable += applied.unreadable
        self.records += records
        self.last_progress = time.monotonic()

    def report(self, dropped: int) -> RestoreReport:
        return RestoreReport(self.home, self.tasks, self.tombstones, self.unreadable, dropped,
                             time.monotonic() - self.began, self.records)


Restored = Callable[[RestoreReport], Awaitable[None]]


class Restorer:
    def __init__(self, local: LocalIndex, topics: dict[str, str], consumer_factory: Callable[[], Consumer],
                 clock: Clock, end_factory: Callable[[], Consumer] | None = None,
                 process_from: int | None = PROCESS_FROM, probe_factory: Callable[[], Consumer] | None = None) -> None:
        self.local = local
        self.topics = topics
        self.clock = clock
        self._consumer_factory = consumer_factory
        # The end of a changelog partition is its high watermark, asked with read_uncommitted: a read_committed
        # consumer's "end" is the last stable offset, which stops short of everything committed after an open
        # transaction (a crashed owner's), and a restore that stopped there would miss it.
        self._end_factory = end_factory or consumer_factory
        self._probe_factory = probe_factory or consumer_factory  # reads past a stalled partition's markers
        self._thread = OneThread("rdq-restore")
        # Records to restore from which they are decoded in a process; None: never (no core to spare for it).
        self.process_from = process_from
        self.decoded_in_process = 0  # batches of the last restore decoded in the process (the bench prints it)
        # Where a restore's time goes: reading and decoding (the restore thread or the decoding process), applying
        # (the store), and the wait for a read the store did not hide (the pipeline's stall). The bench prints them.
        self.seconds = {"fetch": 0.0, "decode": 0.0, "apply": 0.0, "waited": 0.0}

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._thread.call(fn, *args)

    async def restore(self, home: Home, wanted: Callable[[], bool] = lambda: True) -> RestoreReport:
        """Restore one home partition from the beginning of its changelog. `wanted()` false: give up (revoked)."""
        reports: list[RestoreReport] = []

        async def keep(report: RestoreReport) -> None:
            reports.append(report)

        failed = await self.restore_many([home], lambda _: wanted(), keep)
        if home in failed:
            raise failed[home]
        return reports[0]

    async def restore_many(self, homes: Sequence[Home], wanted: Callable[[Home], bool],
                           restored: Restored) -> dict[Home, Exception]:
        """Restore these home partitions from the beginning of their changelogs, all at once through one consumer.
        `restored(report)` is awaited as each one finishes (it may make its partition ready then); a home whose
        `wanted(home)` turns false is given up (revoked). Returns the homes not restored, with why."""
        failed: dict[Home, Exception] = {}
        parts: dict[Changelog, _Restoring] = {}
        for home in homes:
            topic = self.topics.get(home[0])
            if topic is None:  # the source topic did not exist when the bridge started
                failed[home] = RestoreFailed(f"{home[0]} has no changelog topic yet")
            else:
                part = _Restoring(home, topic)
                parts[part.partition] = part
        if not parts:
            return failed
        try:
            ends = await self._call(self._ends_of, list(parts))
        except Exception as e:
            for part in parts.values():
                failed[part.home] = RestoreFailed(f"{part.topic}/{part.home[1]}: cannot read the changelog's end: "
                                                  f"{e}")
            return failed
        for key, (low, high) in ends.items():
            parts[key].start, parts[key].end, parts[key].empty = low, high, high <= low
        decoder = Decoder(lambda records: self._call(pick_last, records, _YIELD_EVERY))
        if self.process_from is not None and sum(high - low for low, high in ends.values()) >= self.process_from:
            decoder.start()
        consumer: Consumer = await self._call(self._consumer_factory)
        try:
            reading: dict[Changelog, _Restoring] = {}
            for key, part in parts.items():
                await self.local.restore_begin(part.home)  # an empty changelog too: it holds none of them
                if part.empty:
                    await self._finish(part, restored, failed, wanted)
                else:
                    reading[key] = part
            if reading:
                await self._call(self._assign_from_start, consumer, reading)
                await self._read_all(consumer, decoder, reading, wanted, restored, failed)
        except (KafkaException, StoreError) as e:
            for part in parts.values():
                if not part.done:
                    failed[part.home] = RestoreFailed(f"{part.topic}/{part.home[1]}: {e}")
        finally:
            self.decoded_in_process = decoder.batches_in_process
            decoder.close()
            await self._call(consumer.close)
            await self._call(give_back_freed_memory)  # the batches' memory, kept by malloc otherwise
        return failed

    def _ends_of(self, partitions: list[Changelog]) -> dict[Changelog, tuple[int, int]]:
        probe = self._end_factory()
        try:
            ends = {}
            for topic, partition in partitions:
                low, high = probe.get_watermark_offsets(TopicPartition(topic, partition), 10.0, cached=False)
                ends[(topic, partition)] = int(low), int(high)
            return ends
        finally:
            probe.close()

    @staticmethod
    def _assign_from_start(consumer: Consumer, reading: dict[Changelog, _Restoring]) -> None:
        """Each partition from its log start as `_ends_of` found it, not OFFSET_BEGINNING, with its topic's metadata
        asked first: librdkafka resolves a logical offset by a ListOffsets of its own that comes ~0.5 s later, and a
        new consumer's fetcher waits for its first metadata refresh (a fresh consumer's first record 0.60 s after
        the assignment, 0.10 s from the known offsets, 0.01 s with the metadata too: bench/RESULTS.md,
        2026-12-07). Should the log start move on meanwhile (retention), the fetch is out of range and
        `auto.offset.reset` (earliest) takes the partition from its new start."""
        for topic in sorted({topic for topic, _ in reading}):
            consumer.list_topics(topic, timeout=10.0)
        consumer.assign([TopicPartition(*key, part.start) for key, part in reading.items()])

    async def _read_all(self, consumer: Consumer, decoder: Decoder, reading: dict[Changelog, _Restoring],
                        wanted: Callable[[Home], bool], restored: Restored, failed: dict[Home, Exception]) -> None:
        """Read every partition to its end; each one finished as soon as its end is reached. Pipelined: the next
        batches (`_READ_AHEAD`) are read and decoded while the store applies this one, and applied in the order
        they were read, whichever finished decoding first."""
        ahead: deque[asyncio.Future[Fetched]] = deque()  # read (and decoding) while the store applies a batch
        try:
            while reading:
                for key, part in list(reading.items()):
                    if not wanted(part.home):
                        part.done = True
                        failed[part.home] = RestoreFailed(f"{part.topic}/{part.home[1]}: no longer assigned")
                        await self._leave(consumer, reading, key)
                if not reading:
                    return
                while len(ahead) < _READ_AHEAD:
                    ahead.append(asyncio.ensure_future(self._read_decoded(consumer, decoder, _ends(reading))))
                began = time.monotonic()
                fetched = await ahead.popleft()  # in the order read: a task's later record is applied last
                self.seconds["waited"] += time.monotonic() - began
                self.seconds["fetch"] += fetched.seconds
                self.seconds["decode"] += fetched.decoding
                ahead.append(asyncio.ensure_future(self._read_decoded(consumer, decoder, _ends(reading))))
                await self._apply(fetched, reading, consumer, failed)
                for key, part in list(reading.items()):
                    part.reached = max(part.reached, fetched.reached.get(key, -1))  # only once its batch is in
                    if part.reached >= part.end or await self._stalled_at_markers(consumer, part):
                        await self._leave(consumer, reading, key)
                        await self._finish(part, restored, failed, wanted)
        finally:
            await asyncio.gather(*ahead, return_exceptions=True)  # the consumer closes after them, on its thread

    async def _apply(self, fetched: Fetched, reading: dict[Changelog, _Restoring], consumer: Consumer,
                     failed: dict[Home, Exception]) -> None:
        """Each partition's batch, all in one group commit: one fsync a fetch, not one a partition (1M tasks over 12
        partitions: 18.0k -> 20.8k tasks/s)."""
        for warning in fetched.warnings:
            log.warning("restoring %s", warning)
        batches: list[tuple[_Restoring, Picked, int, list[str]]] = [
            (part, picked, records, []) for key, (picked, records) in fetched.batches.items()
            if (part := reading.get(key)) is not None]  # none: finished or given up while it was fetched
        began = time.monotonic()
        outcomes = await asyncio.gather(*(self.local.restore_batch(part.home, part.topic, picked, self.clock.now_ms(),
                                                                   errors)
                                          for part, picked, _, errors in batches), return_exceptions=True)
        self.seconds["apply"] += time.monotonic() - began
        for (part, _, records, errors), applied in zip(batches, outcomes, strict=True):
            if isinstance(applied, StoreError):
                part.done = True
                failed[part.home] = RestoreFailed(f"{part.topic}/{part.home[1]}: {applied}")
                await self._leave(consumer, reading, part.partition)
                continue
            if isinstance(applied, BaseException):
                raise applied
            part.count(applied, records)
            for why in errors:
                log.error("changelog record unreadable (kept in the store, counted; the restore goes on): %s", why)

    async def _read_decoded(self, consumer: Consumer, decoder: Decoder, ends: dict[Changelog, int]) -> Fetched:
        """The next batch of each partition, read, then reduced to its tasks' last records (decoded off the
        store's thread: `Decoder`)."""
        fetched: Fetched = await self._call(self._fetch, consumer, ends)
        for key, records in fetched.records.items():
            picked = await decoder.pick(records)
            fetched.batches[key] = (picked, len(records))
            fetched.decoding += picked.seconds
        return fetched

    @staticmethod
    def _fetch(consumer: Consumer, ends: dict[Changelog, int]) -> Fetched:
        """On the restore thread: a consumed batch per changelog partition, in log order, and how far each
        partition was read: by its records, end-of-partition events and the consumer's position, which steps over
        the commit markers (a changelog whose last record is a marker is at its end once its position is). A batch
        is _BATCH records or what came within _POLL, or less once every partition asked for (`ends`) is read to
        its end: nothing more is coming, and a small restore waited out _POLL in each of its fetches (24
        partitions of 5 tasks: 0.22 s a restore, bench/RESULTS.md 2026-12-07)."""
        fetched, began = Fetched(), time.monotonic()
        deadline, wanted = began + _POLL, _BATCH
        while wanted > 0:
            messages = consumer.consume(wanted, max(0.0, min(deadline - time.monotonic(), _SLICE)))
            wanted -= len(messages)
            fetched.take(messages, ends)
            for tp in consumer.position([TopicPartition(*key) for key in ends]) if ends else []:
                if tp.error is None and tp.offset >= 0:
                    fetched.reach((tp.topic, tp.partition), tp.offset)
            if time.monotonic() >= deadline or fetched.at_ends(ends):
                break
        fetched.seconds = time.monotonic() - began
        return fetched

    async def _stalled_at_markers(self, consumer: Consumer, part: _Restoring) -> bool:
        """Nothing came for a while: finished if only commit markers were left before the end; else say what it
        waits for. Only markers left is asked of the changelog itself (`_nothing_left_to_read`): a partition the
        restore consumer had not fetched for a while (it was reading the assignment's other partitions) once
        passed for finished, and its unread tasks would have been dropped as purged."""
        if time.monotonic() - part.last_progress <= _STALL_WARN:
            return False
        tp = TopicPartition(*part.partition)
        _, stable = await self._call(consumer.get_watermark_offsets, tp, 10.0, False)
        part.last_progress = time.monotonic()
        if stable < part.end:
            log.warning("restoring %s/%d: waiting at offset %d for %d (an open transaction of the previous owner "
                        "holds it until the broker aborts it)", part.topic, part.home[1], part.reached, part.end)
            return False
        if part.reached >= 0 and await asyncio.to_thread(self._nothing_left_to_read, part):
            return True  # (one never fetched has not been read by its position either: not one to probe)
        log.warning("restoring %s/%d: at offset %d of %d, its records not fetched for %.0f s (the restore consumer "
                    "is reading the other partitions)", part.topic, part.home[1], part.reached, part.end, _STALL_WARN)
        return False

    def _nothing_left_to_read(self, part: _Restoring) -> bool:
        """By a consumer of its own, committed records only, from where the partition was reached: it comes to the
        end with no record (commit markers only), or finds one still to restore (or cannot tell in time)."""
        probe = self._probe_factory()
        try:
            probe.assign([TopicPartition(*part.partition, part.reached)])
            deadline = time.monotonic() + _PROBE_WITHIN
            while time.monotonic() < deadline:
                msg = probe.poll(0.2)
                if msg is None:
                    continue
                error = msg.error()
                if error is None:
                    return False
                if error.code() == KafkaError._PARTITION_EOF:
                    return (msg.offset() or 0) >= part.end
            return False
        finally:
            probe.close()

    async def _leave(self, consumer: Consumer, reading: dict[Changelog, _Restoring], key: Changelog) -> None:
        """This partition is done (finished or given up): no more fetches of it while the others go on."""
        del reading[key]
        await self._call(consumer.pause, [TopicPartition(*key)])

    async def _finish(self, part: _Restoring, restored: Restored, failed: dict[Home, Exception],
                      wanted: Callable[[Home], bool]) -> None:
        """The partition's restore ends: what the changelog no longer holds leaves the file. Not for a partition no
        longer wanted: a restore of an earlier assignment (its ends asked slowly, say) must not drop what a later
        one restored and logged since."""
        part.done = True
        if not wanted(part.home):
            failed[part.home] = RestoreFailed(f"{part.topic}/{part.home[1]}: no longer assigned")
            return
        try:
            dropped = await self.local.restore_finish(part.home)
            await restored(part.report(dropped))
        except (KafkaException, StoreError) as e:
            failed[part.home] = RestoreFailed(f"{part.topic}/{part.home[1]}: {e}")


def _ends(reading: dict[Changelog, _Restoring]) -> dict[Changelog, int]:
    return {key: part.end for key, part in reading.items()}

