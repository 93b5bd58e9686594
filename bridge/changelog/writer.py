"""The changelog writer (SPEC §10): one Kafka transaction per round carries, atomically,

- the DLQ records due (SPEC §5.3) and, for each, its task's changelog record marked published;
- every task transition stored in SQLite and not yet in the changelog (the outbox: version > logged_version);
- tombstones of purged tasks;
- the source offsets of the partitions this instance owns, through `send_offsets_to_transaction` with the
  consumer's group metadata (KIP-447).

So "task durable in Kafka" and "source offset committed" are one step, a DLQ record is never published twice
(its "published" mark commits with it), and a zombie — an instance that lost its partitions without noticing —
cannot write: its group generation is stale, the coordinator refuses its offsets and the transaction aborts.

Every producer call runs on one dedicated thread; SQLite reads and marks go through the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from bridge.aio import Backoff
from bridge.changelog.calls import ProducerCalls
from bridge.changelog.holds import Holds
from bridge.changelog.local import ROUND_BYTES, Entry, Home, LocalIndex
from bridge.changelog.transaction import (
    CALL_TIMEOUT,
    COMMIT_PATIENCE,
    Delivered,
    DeliveredRecord,
    DlqItem,
    Fenced,
    Round,
    commit,
)
from bridge.changelog.waiters import LoggedWaiters, RoundWaiters
from bridge.clock import Clock
from bridge.store.database import StoreError
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)
_BATCH = 5000  # outbox rows per transaction
# A round that found this many (or a round's bytes, local.ROUND_BYTES): a backlog builds, the next round starts
# at once rather than after `interval` (a wait there, with rounds only starting at once after a full batch, left
# the writer a fifth idle on the failure path while its backlog grew: bench_kafka failure).
_BACKLOG = 500
_ABORT_TRIES = 5  # aborts failed in a row: the producer is replaced
_ROUND_TRIES = 5  # rounds failed in a row (not fenced), each aborted cleanly: the producer is replaced
_DLQ_BATCH = 500
_FENCED = {KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID, KafkaError.FENCED_INSTANCE_ID,
           KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.REBALANCE_IN_PROGRESS}
class ChangelogWriter:
    def __init__(self, local: LocalIndex, topics: dict[str, str], producer_factory: Callable[[], Producer],
                 offsets: Callable[[], dict[Home, int]], group_metadata: Callable[[], Any | None], clock: Clock,
                 interval: float = 0.1, telemetry: Telemetry | None = None,
                 writable: Callable[[], frozenset[Home]] | None = None) -> None:
        self.local = local
        self.topics = topics  # source topic → changelog topic
        self.clock = clock
        self.interval = interval
        self.telemetry = telemetry or Telemetry()
        self._producer_factory = producer_factory
        self._offsets = offsets
        self._fence = Fenced(topics, group_metadata, writable)
        self._producer: Producer | None = None
        self._calls = ProducerCalls("rdq-changelog")
        self._dlq: list[DlqItem] = []
        self._holds = Holds()  # sent, their marks not committed yet: not read again meanwhile
        self._waiters = LoggedWaiters(local, self._holds.holds)
        self._last_offsets: dict[Home, int] = {}
        self._round_lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._rounds = 0  # rounds that succeeded
        self._round_waiters = RoundWaiters(self._kick)
        self._abort_failures = 0  # aborts failed in a row
        self._round_failures = 0  # rounds failed in a row, fenced ones not counted
        self._stop = asyncio.Event()  # the bridge's, once running: a producer replaced during a stop gives up
        self.healthy = True
        self.stats = {"transactions": 0, "aborted": 0, "records": 0, "fenced": 0}
        # Where the rounds' time goes (one round at a time: these add up to the writer's busy time).
        self.seconds = {"outbox": 0.0, "transaction": 0.0, "mark": 0.0, "waiters": 0.0}

    # ---- what the rest of the bridge asks ------------------------------------------------------------------

    def when_logged(self, task_id: str, callback: Callable[[], None], written_since: float | None = None) -> None:
        """Call `callback` (on the loop) once the task's stored state is in the changelog (or it is gone).
        `written_since`: that state was queued for the store at or after this `time.monotonic()` (None: unknown)."""
        self._waiters.add(task_id, callback, written_since)

    async def logged(self, task_id: str, within: float) -> bool:
        """Wait until the task's stored state is in the changelog and the source offsets of that moment are
        committed (True), at most `within` seconds (False). A round takes its offsets before it logs its tasks, so
        the offset a newly stored task frees is committed by the round after: without waiting for it, a handler
        that kills the process left its record uncommitted, and on a new disk it ran again inline, uncounted."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        done: asyncio.Future[int] = loop.create_future()

        def resolve() -> None:
            if not done.done():
                done.set_result(self._rounds)

        self.when_logged(task_id, resolve)
        self._kick.set()
        try:
            during = await asyncio.wait_for(done, within)
            # The round that logged it ends, then one that reads offsets after: woken by the round's end, not by
            # polling (a poll every 20 ms was most of a retry's wait once the rounds themselves were quick).
            await asyncio.wait_for(self._round_waiters.reach(during + 2, self._rounds),
                                   max(0.0, deadline - loop.time()))
        except TimeoutError:
            return False
        return True

    def produce_dlq(self, task_id: str, home: Home | None, topic: str, key: bytes | None, value: bytes,
                    headers: list[tuple[str, bytes | None]], on_delivery: Delivered) -> None:
        """Queue a DLQ record for the next transaction; `on_delivery(err, msg)` once it committed (or failed)."""
        self._dlq.append(DlqItem(task_id, home, topic, key, value, headers, on_delivery))
        self._kick.set()

    async def flush(self) -> bool:
        """Rounds now (a revoke, a stop) until nothing of this instance is unlogged and the offsets committed are
        the current ones: a round's offsets are taken before its tasks are logged, so the records those tasks
        stand for are committed by the next round. True when that was reached."""
        if self._producer is None:
            return False
        for _ in range(3):
            if not await self._one_round():
                return False
            await self._holds.settled()
            async with self._round_lock:  # not while a round asks: it would leave them waiting again
                await self._waiters.resolve_held()
            if not await self.local.outbox(1) and self._offsets() == self._last_offsets:
                return True
        return False

    # ---- the loop ------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        await self._start_producer(stop)
        # Returns on stop; the producer and its thread stay for the consumer's last hand-over (close() after).
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.interval)
            self._kick.clear()
            if not await self._one_round():
                await asyncio.sleep(min(1.0, self.interval * 5))

    async def close(self) -> None:
        """After the consumer's last flush: one more round (late marks), then the thread goes."""
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._one_round()
        with contextlib.suppress(Exception):
            await self._holds.settled()
        self._calls.shutdown()
        self.local.close()

    async def _start_producer(self, stop: asyncio.Event) -> None:
        """Until a producer's transactions start; once stopping, one try (the last hand-over may need it)."""
        backoff = Backoff(0.5, 5.0)
        while True:
            try:
                producer = self._producer_factory()
                await self._calls.call(30.0, producer.init_transactions, 30.0)
                self._producer = producer
                await self._push_premigration()
                return
            except KafkaException as e:
                if stop.is_set():
                    log.warning("changelog producer cannot start its transactions; the bridge is stopping, so "
                                "what is not logged stays in the store for the next start: %s", e)
                    return
                log.warning("changelog producer cannot start its transactions yet (retrying): %s", e)
                await backoff.sleep()

    async def _push_premigration(self) -> None:
        """An existing store's tasks (from before the changelog) go to the changelog of their partition, whoever
        owns it: one transaction per batch, without offsets (the group is not involved). The owner runs them
        from its next restore of that partition; until written, they stay in this file."""
        total = 0
        while entries := await self.local.premigration(_BATCH):
            work = Round(entries=entries)
            try:
                await self._calls.call(CALL_TIMEOUT, self._fence.begin_and_send_dlq, self._producer, [])
                await self._calls.call(CALL_TIMEOUT, self._fence.send, self._producer, work, True)
                await self._calls.call(COMMIT_PATIENCE + CALL_TIMEOUT, commit, self._producer)
            except KafkaException as e:
                await self._abort_or_restart(e.args[0] if e.args else e)
                log.error("cannot write the tasks stored before the changelog to it yet (kept, retried at the "
                          "next start): %s", e)
                return
            await _mark(self.local, entries)
            total += len(entries)
        if total:
            log.info("wrote %d tasks stored before the changelog existed to their changelog partitions", total)

    async def _one_round(self) -> bool:
        async with self._round_lock:
            if self._producer is None:  # replaced during a stop, and the stop came first: nothing can be written
                return False
            try:
                ok = await self._round()
                self._rounds += ok  # a round that succeeded: its offsets, read at its start, are committed
                if ok:
                    self._round_failures = 0
                    self._round_waiters.ended(self._rounds)
                return ok
            except StoreError as e:
                log.error("changelog round failed on the store (retrying): %s", e)
                return False

    async def _round(self) -> bool:
        offsets = self._offsets()
        dlq, self._dlq = self._dlq[:_DLQ_BATCH], self._dlq[_DLQ_BATCH:]
        began = time.monotonic()
        entries, idle = await self._holds.read(self.local, _BATCH, skip=[i.task_id for i in dlq])
        work_read = time.monotonic()
        self.seconds["outbox"] += work_read - began
        self.telemetry.metrics.changelog_unlogged.set(len(entries))
        if not dlq and not entries and offsets == self._last_offsets:
            await self._waiters.resolve(set(), work_read, idle=idle)
            return True
        work = Round(dlq, entries, offsets=offsets, read_ended=work_read, idle=idle)
        ok = await self._transaction(work)
        if len(entries) >= _BACKLOG or sum(len(e.value or b"") for e in entries) >= ROUND_BYTES or self._dlq:
            self._kick.set()  # more waits: the next round at once
        return ok

    async def _transaction(self, work: Round) -> bool:
        assert self._producer is not None
        began = time.monotonic()
        try:
            await self._calls.call(CALL_TIMEOUT, self._fence.begin_and_send_dlq, self._producer, work.dlq)
            for item in work.dlq:
                if item.delivered is not None and item.home is not None and item.home[0] in self.topics:
                    entry = await self.local.snapshot_published(item.task_id, item.topic, *item.delivered,
                                                                self.clock.now_ms())
                    if entry is None:
                        # Its task left this store (its partition was lost and dropped): the new owner restored it
                        # and publishes it. Published here too, unfenced, it was a DLQ duplicate.
                        raise KafkaException(KafkaError(KafkaError._FENCED, f"task {item.task_id} is no longer "
                                                                            "here: its partition moved"))
                    work.dlq_entries.append(entry)
            sent = time.monotonic()
            await self._calls.call(CALL_TIMEOUT, self._fence.send, self._producer, work)
            committing = time.monotonic()
            await self._calls.call(COMMIT_PATIENCE + CALL_TIMEOUT, commit, self._producer)
            if time.monotonic() - sent > 1.0:
                log.warning("slow changelog transaction: records and offsets %.2fs, commit %.2fs",
                            committing - sent, time.monotonic() - committing)
        except KafkaException as e:
            refused = [i for i in work.dlq if i.error is not None and not i.collateral]
            if refused:
                # One DLQ record the broker refuses (too large, no such topic) must not hold the others: it
                # waits for its own retry; the rest go again in the next round.
                again = [i for i in work.dlq if i.error is None or i.collateral]
                work.dlq, self._dlq = refused, [*again, *self._dlq]
                for item in again:
                    item.delivered, item.error, item.collateral = None, None, False
                self._kick.set()
            await self._failed(work, e.args[0] if e.args else e)
            return False
        finally:
            self.seconds["transaction"] += time.monotonic() - began
        await self._committed(work)
        return True

    async def _committed(self, work: Round) -> None:
        self.stats["transactions"] += 1
        self.stats["records"] += len(work.entries) + len(work.dlq_entries) + len(work.dlq)
        self.telemetry.metrics.changelog_commits.labels("committed").inc()
        self._last_offsets = work.offsets
        self.healthy = True
        # The DLQ tasks' states before the published mark are covered by it (same record, one version later).
        before_publish = [Entry(e.task_id, e.home, e.version - 1, b"") for e in work.dlq_entries]
        began = time.monotonic()
        # Not waited for (the next round's read leaves out what is held), but queued before the DLQ callbacks'
        # own writes: mark_dlq_published finds the state before the publish logged.
        self._holds.sent([*work.entries, *work.dlq_entries], _mark_soon(self.local, work.entries + before_publish))
        self.seconds["mark"] += time.monotonic() - began
        for item in work.dlq:
            assert item.delivered is not None
            item.on_delivery(None, DeliveredRecord(item.topic, *item.delivered))
        began = time.monotonic()
        await self._waiters.resolve({e.task_id for e in [*work.entries, *work.dlq_entries]}, work.read_ended,
                                    work.idle)
        self.seconds["waiters"] += time.monotonic() - began

    async def _failed(self, work: Round, error: Any) -> None:
        self.healthy = False
        code = error.code() if isinstance(error, KafkaError) else None
        fenced = code in _FENCED
        self._round_failures += not fenced
        self.stats["aborted"] += 1
        self.telemetry.metrics.changelog_commits.labels("fenced" if fenced else "aborted").inc()
        if fenced:
            self.stats["fenced"] += 1
            log.warning("changelog transaction refused: this instance's group generation is stale (its partitions "
                        "moved); nothing of it was written: %s", error)
        else:
            log.error("changelog transaction failed (retried; offsets do not move meanwhile): %s", error)
        await self._abort_or_restart(error)
        for item in work.dlq:
            item.on_delivery(item.error or str(error), None)

    async def _abort_or_restart(self, error: Any) -> None:
        assert self._producer is not None
        fatal = isinstance(error, KafkaError) and error.fatal()
        # The round itself met _CONFLICT: an abort that timed out here (30 s) still runs in librdkafka, its request
        # unsent in a wedged coordinator connection; resuming it timed out again, 30 s a round, until five had
        # (the nemesis: 2.5 minutes without a logged round, its drain bound passed). A new producer, same
        # transactional.id, fences the old one and ends its transaction at once.
        wedged = isinstance(error, KafkaError) and error.code() == KafkaError._CONFLICT
        if not fatal and not wedged:
            try:
                await self._calls.call(30.0, self._producer.abort_transaction, 30.0)
                self._abort_failures = 0
                if self._round_failures < _ROUND_TRIES:
                    return
                # Round after round failing, each aborted cleanly: a producer wedged where librdkafka does not
                # heal it (the nemesis saw 7 minutes of AddOffsetsToTxn requests timing out in the coordinator
                # connection's queue, unsent). A new producer with the same transactional.id starts afresh.
                log.warning("%d changelog rounds failed in a row; starting a new producer", self._round_failures)
                self._round_failures = 0
                self._producer = None
                await self._start_producer(self._stop)
                return
            except KafkaException as e:
                failure = e.args[0]
                self._abort_failures += 1
                # _CONFLICT: an earlier abort (timed out here) still runs in librdkafka; asking again conflicts
                # with it round after round. A new producer, same transactional.id, fences it at once.
                if (failure.retriable() and not failure.fatal() and failure.code() != KafkaError._CONFLICT
                        and self._abort_failures < _ABORT_TRIES):
                    log.warning("changelog abort failed (resumed with the next round): %s", e)
                    return
                # Not retriable (librdkafka: treat it as fatal), or the same failure round after round (a state
                # the abort cannot leave, e.g. a conflicting API call): left so, every round would fail for ever.
        log.warning("changelog producer hit a fatal error; starting a new one: %s", error)
        self._producer = None
        self._abort_failures = 0
        # Not a fresh event: with the broker gone during a stop, that retry loop kept the stop from ever ending.
        await self._start_producer(self._stop)


def _warn_if_failed(mark: asyncio.Future[None]) -> None:
    if not mark.cancelled() and mark.exception() is not None:
        log.warning("cannot mark changelog records as logged (sent again next round, the same state): %s",
                    mark.exception())


def _mark_soon(local: LocalIndex, entries: list[Entry]) -> asyncio.Future[None]:
    try:
        mark = local.mark_logged_soon(entries)
    except StoreError as e:  # not marked: sent again next round (harmless, the same state)
        log.warning("cannot mark changelog records as logged: %s", e)
        mark = asyncio.get_running_loop().create_future()
        mark.set_result(None)
    mark.add_done_callback(_warn_if_failed)
    return mark


async def _mark(local: LocalIndex, entries: list[Entry]) -> None:
    backoff = Backoff(0.1, 5.0)
    while True:
        try:
            await local.mark_logged(entries)
            return
        except StoreError as e:  # logged but not marked: written again next round (harmless, same state)
            log.warning("cannot mark changelog records as logged yet (retrying): %s", e)
            await backoff.sleep()
            if backoff.delay >= 5.0:
                return
