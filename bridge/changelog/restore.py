"""Assign → restore → run (SPEC §10): a source partition's tasks are read from its changelog partition into SQLite
before any of them runs and before the partition is consumed.

The restore reads with `isolation.level=read_committed` (aborted writes of a zombie or of a crashed owner are
skipped) up to the high watermark seen when it began: an open transaction of a crashed owner holds it until the
broker aborts it (`transaction.timeout.ms`). The changelog wins over the local file; tasks the changelog never
saw stay and are logged (see LocalIndex.restore_finish).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from bridge.changelog.local import Home, LocalIndex
from bridge.clock import Clock

log = logging.getLogger(__name__)
_BATCH = 5000
_STALL_WARN = 10.0


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


class Restorer:
    def __init__(self, local: LocalIndex, topics: dict[str, str], consumer_factory: Callable[[], Consumer],
                 clock: Clock, end_factory: Callable[[], Consumer] | None = None) -> None:
        self.local = local
        self.topics = topics
        self.clock = clock
        self._consumer_factory = consumer_factory
        # The end of a changelog partition is its high watermark, asked with read_uncommitted: a read_committed
        # consumer's "end" is the last stable offset, which stops short of everything committed after an open
        # transaction (a crashed owner's), and a restore that stopped there would miss it.
        self._end_factory = end_factory or consumer_factory
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rdq-restore")

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def restore(self, home: Home, wanted: Callable[[], bool] = lambda: True) -> RestoreReport:
        """Restore one home partition from the beginning of its changelog. `wanted()` false: give up (revoked)."""
        began = time.monotonic()
        topic = self.topics.get(home[0])
        if topic is None:  # the source topic did not exist when the bridge started
            raise RestoreFailed(f"{home[0]} has no changelog topic yet")
        consumer: Consumer = await self._call(self._consumer_factory)
        try:
            tp = TopicPartition(topic, home[1])
            try:
                low, high = await self._call(self._end_of, tp)
            except Exception as e:
                raise RestoreFailed(f"{topic}/{home[1]}: cannot read the changelog's end: {e}") from e
            seen: set[str] = set()
            counts = {"tasks": 0, "tombstones": 0, "unreadable": 0, "records": 0}
            if high > low:
                existing = await self.local.home_ids(home)
                await self._call(consumer.assign, [TopicPartition(topic, home[1], OFFSET_BEGINNING)])
                await self._read_until(consumer, home, topic, high, seen, counts, wanted, existing)
            dropped = await self.local.restore_finish(home, seen)
        finally:
            await self._call(consumer.close)
        report = RestoreReport(home, counts["tasks"], counts["tombstones"], counts["unreadable"], dropped,
                               time.monotonic() - began, counts["records"])
        return report

    def _end_of(self, tp: TopicPartition) -> tuple[int, int]:
        probe = self._end_factory()
        try:
            low, high = probe.get_watermark_offsets(tp, 10.0, cached=False)
            return int(low), int(high)
        finally:
            probe.close()

    async def _read_until(self, consumer: Consumer, home: Home, topic: str, end: int, seen: set[str],
                          counts: dict[str, int], wanted: Callable[[], bool], existing: frozenset[str]) -> None:
        reached = -1
        last_progress = time.monotonic()
        errors: list[str] = []
        while reached < end:
            if not wanted():
                raise RestoreFailed(f"{topic}/{home[1]}: no longer assigned")
            messages = await self._call(consumer.consume, _BATCH, 0.5)
            batch = []
            for msg in messages:
                error = msg.error()
                if error is None:
                    batch.append((msg.offset(), msg.key(), msg.value()))
                    reached = max(reached, msg.offset() + 1)
                elif error.code() == KafkaError._PARTITION_EOF:
                    reached = max(reached, msg.offset())
                else:
                    log.warning("restoring %s/%d: %s", topic, home[1], error)
            if batch:
                last_progress = time.monotonic()
                applied = await self.local.restore_batch(home, topic, batch, seen, self.clock.now_ms(), errors,
                                                         existing)
                counts["tasks"] += applied.applied
                counts["tombstones"] += applied.tombstones
                counts["unreadable"] += applied.unreadable
                counts["records"] += len(batch)
                for why in errors:
                    log.error("changelog record unreadable (kept in the store, counted; the restore goes on): %s",
                              why)
                errors.clear()
            elif time.monotonic() - last_progress > _STALL_WARN:
                tp = TopicPartition(topic, home[1])
                position = (await self._call(consumer.position, [tp]))[0].offset
                _, stable = await self._call(consumer.get_watermark_offsets, tp, 10.0, False)
                if position >= end or (stable >= end and reached >= 0):
                    return  # nothing open before the end, and nothing came for a while: only markers were left
                log.warning("restoring %s/%d: waiting at offset %d for %d (an open transaction of the previous "
                            "owner holds it until the broker aborts it)", topic, home[1], max(reached, position), end)
                last_progress = time.monotonic()
