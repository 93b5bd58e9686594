"""Dead-lettering (SPEC §5.3, §6): the DLQ outbox publisher (the envelope is dlq/envelope.py).

DEAD is committed in the store first; this publisher then sends each unpublished DEAD task to its queue's DLQ
topic (idempotent producer, acks=all) and records where it landed. What is not acknowledged stays in the outbox
and is sent again: after a broker outage, after a restart. A record over the topic's size limit keeps its
payload and is trimmed (stacks, then middle attempts), saying what was trimmed; it is never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any, cast

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from bridge.aio import Backoff, first_of
from bridge.changelog.writer import ChangelogWriter
from bridge.clock import Clock
from bridge.config import BridgeConfig
from bridge.dlq.envelope import draft_record, fitted
from bridge.kafka_clients import dlq_batch_bytes, topic_max_message_bytes
from bridge.model import Task
from bridge.records import TRACEPARENT
from bridge.store.database import StoreError
from bridge.store.outbox import OutboxEntry
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)
_RETRY_FIRST = 5.0  # an outbox entry whose publish failed waits this long, doubling per failure…
_RETRY_MAX = 300.0  # …up to this; the entries behind it do not wait for it
_STUCK_EVERY_MS = 1000


class DlqPublisher:
    """Publishes the outbox; runs until `stop`, then waits a little for what is in flight."""

    def __init__(self, store: Store, config: BridgeConfig, producer_factory: Callable[[int], Producer],
                 admin_factory: Callable[[], AdminClient], clock: Clock, wake: asyncio.Event,
                 batch: int = 500, telemetry: Telemetry | None = None,
                 changelog: ChangelogWriter | None = None) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.wake = wake
        self.batch = batch
        self.telemetry = telemetry or Telemetry()
        self._producer_factory = producer_factory
        self._admin_factory = admin_factory
        self._producer: Producer | None = None
        # With the changelog (SPEC §10): each record goes out in the changelog's transaction, with its task's
        # "published" mark: exactly once, even if the bridge dies right after.
        self.changelog = changelog
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, Task] = {}
        self._next: Awaitable[list[OutboxEntry]] | None = None  # the next batch, read while this one goes out
        self._stuck_queues: set[str] = set()
        self._stuck_checked = -_STUCK_EVERY_MS
        self._failures_since_check = False
        self._stopping = False
        self._limits: dict[str, int] = {}
        self._marking: set[asyncio.Task[None]] = set()
        self._acked: list[tuple[Task, str, int, int]] = []  # acknowledged, not yet marked published
        self._marker: asyncio.Task[None] | None = None
        self._polling = threading.Event()
        self.published = 0

    def topic_for(self, task: Task) -> str:
        queue = self.config.queues.get(task.queue)
        return (queue.dlq_topic if queue and queue.dlq_topic else None) or f"{task.queue}.dlq"

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        limits = [await self._limit(self.config.dlq_topic(q)) for q in self.config.queues]
        if self.changelog is None:
            self._producer = self._producer_factory(dlq_batch_bytes(limits))
            self._polling.set()
        poller = threading.Thread(target=self._poll, name="rdq-dlq-poll", daemon=True)
        poller.start()
        try:
            while not stop.is_set():
                self.wake.clear()
                sent = 0
                with contextlib.suppress(StoreError):
                    sent = await self.publish_due()
                if sent >= self.batch:
                    await asyncio.sleep(0)  # a full batch: more may wait in the outbox, go on at once
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(first_of(self.wake, stop), 1.0)
        finally:
            await self._finish(poller)

    async def publish_due(self) -> int:
        """Send every unpublished DEAD task due for a try and not already on its way. Returns how many were sent.

        The next batch is read (on the store's reader thread) while this one is built and produced: its read
        skips this batch's entries as well as those on their way. One entry that cannot be built or sent is given
        its own retry time and error (kept in the store) and the others go on: nothing about one task blocks the
        outbox, or stops the bridge."""
        prefetched, self._next = self._next, None
        entries = await (prefetched or self._read(()))
        if len(entries) >= self.batch:
            self._next = asyncio.ensure_future(self._read(entry.task.id for entry in entries))
        sent = 0
        for entry in entries:
            task = entry.task
            if task.id in self._pending:
                continue  # a guard: the read skipped the pending ones
            topic = self.topic_for(task)
            try:
                limit = await self._limit(topic)
                await self._produce(entry, topic, limit)
            except BufferError:
                break  # the producer queue is full: the rest go next round
            except Exception as e:  # KafkaException, or an envelope that cannot be built (bad data in the task)
                self._pending[task.id] = task
                self._failed(task, f"{type(e).__name__}: {e}")
                continue
            self._pending[task.id] = task
            sent += 1
        await self._report_stuck()
        return sent

    def _read(self, also_skip: Iterable[str]) -> Awaitable[list[OutboxEntry]]:
        skip = [*self._pending, *also_skip]
        return self.store.dlq_outbox_entries(self.batch, self.clock.now_ms(), skip=skip)

    async def _produce(self, entry: OutboxEntry, topic: str, limit: int) -> None:
        task = entry.task
        with self.telemetry.publish_span(task.id, task.queue, topic, task.headers) as span:
            # Traced: the record carries the publish span's context (same trace); untraced: the source's.
            traceparent = self.telemetry.traceparent_of(span, task.headers.get(TRACEPARENT))
            record = draft_record(task, entry.attempts_json, traceparent)
            if record.size > limit:  # trimming re-encodes a large envelope: not on the event loop
                record = await asyncio.to_thread(fitted, record, limit)
            if record.trimmed:
                log.warning("DLQ record trimmed to fit %s (%d bytes): %s", topic, limit, record.trimmed,
                            extra={"task_id": task.id, "queue": task.queue})
            if self.changelog is not None:
                if record.size > limit:
                    # Refused here, not by the broker: a refused record would abort the whole transaction (and
                    # stall it until the producer's message timeout).
                    raise ValueError(f"MSG_SIZE_TOO_LARGE: {record.size} bytes even trimmed, over the {limit} "
                                     f"bytes {topic} takes (the payload is never trimmed)")
                self.changelog.produce_dlq(task.id, task.home, topic, record.key, record.value, record.headers,
                                           partial(self._on_delivery, task))
                return
            assert self._producer is not None
            self._producer.produce(topic, value=record.value, key=record.key, headers=cast(Any, record.headers),
                                   on_delivery=partial(self._on_delivery, task))

    async def _report_stuck(self) -> None:
        """The stuck-entries gauge, at most once a second (a count over the outbox: per batch it cost up to 12% of
        the publisher's time) or at once after a failed publish was recorded."""
        now = self.clock.now_ms()
        if now - self._stuck_checked < _STUCK_EVERY_MS and not self._failures_since_check:
            return
        self._stuck_checked, self._failures_since_check = now, False
        stuck = await self.store.dlq_stuck()
        gauge = self.telemetry.metrics.dlq_stuck
        for queue in set(self._stuck_queues) | set(stuck):
            gauge.labels(queue).set(stuck.get(queue, {}).get("entries", 0))
        self._stuck_queues = set(stuck)

    async def _limit(self, topic: str) -> int:
        if topic not in self._limits:
            topic_limit = await asyncio.to_thread(self._topic_limit, topic)
            producer_limit = int(self.config.kafka.dlq_max_message_bytes)
            self._limits[topic] = min(topic_limit, producer_limit)
        return self._limits[topic]

    def _topic_limit(self, topic: str) -> int:
        return topic_max_message_bytes(self._admin_factory(), topic)

    def _poll(self) -> None:
        while self._polling.is_set():
            assert self._producer is not None
            self._producer.poll(0.1)

    def _on_delivery(self, task: Task, err: Any, msg: Any) -> None:
        assert self._loop is not None
        if err is not None:
            self._loop.call_soon_threadsafe(self._failed, task, str(err))
        else:
            self._loop.call_soon_threadsafe(self._delivered, task, msg.topic(), msg.partition(), msg.offset())

    def _failed(self, task: Task, why: str) -> None:
        """This entry waits for its own retry time (kept in the store, so a restart does not put it first)."""
        delay = min(_RETRY_FIRST * 2 ** min(task.dlq_failures, 16), _RETRY_MAX)
        log.error("DLQ publish failed (try %d; kept in the outbox, retried in %gs): %s", task.dlq_failures + 1,
                  delay, why, extra={"task_id": task.id, "queue": task.queue})
        recording = asyncio.ensure_future(self._record_failure(task, why, self.clock.now_ms() + int(delay * 1000)))
        self._marking.add(recording)
        recording.add_done_callback(self._marking.discard)

    async def _record_failure(self, task: Task, why: str, next_at: int) -> None:
        try:
            await self.store.dlq_publish_failed(task.id, why, next_at)
        except StoreError as e:
            log.error("could not record a DLQ publish failure (the entry is retried at once): %s", e,
                      extra={"task_id": task.id})
        finally:
            self._pending.pop(task.id, None)  # only now: until recorded, the next round must not take it again
            self._failures_since_check = True

    def _delivered(self, task: Task, topic: str, partition: int, offset: int) -> None:
        """Acknowledged: marked with the acknowledgements that came with it, in one store write."""
        self._acked.append((task, topic, partition, offset))
        if self._marker is None or self._marker.done():
            self._marker = asyncio.ensure_future(self._mark_acked())
            self._marking.add(self._marker)
            self._marker.add_done_callback(self._marking.discard)

    async def _mark_acked(self) -> None:
        while self._acked:
            marks, self._acked = self._acked, []
            await self._mark(marks)

    async def _mark(self, marks: list[tuple[Task, str, int, int]]) -> None:
        """Record where the broker put them. While the store cannot be written (full disk) the marks are retried
        and the entries stay pending here: sending them again would put duplicates in the DLQ. Only a stop (or a
        crash) before the marks are written leaves them to be republished: a duplicate, never a loss."""
        backoff = Backoff(0.1, 5.0)
        try:
            while True:
                try:
                    await self.store.mark_dlq_published_many(marks, self.clock.now_ms(),
                                                             logged=self.changelog is not None)
                    break
                except StoreError as e:
                    if self._stopping:
                        log.error("could not record %d DLQ publishes (republished after the restart): %s",
                                  len(marks), e, extra={"task_id": marks[0][0].id})
                        return
                    log.warning("could not record %d DLQ publishes yet (retrying): %s", len(marks), e,
                                extra={"task_id": marks[0][0].id})
                    await backoff.sleep()
            for task, topic, partition, offset in marks:
                self.published += 1
                self.telemetry.metrics.dlq_published.labels(task.queue).inc()
                log.info("dead-lettered to %s/%d/%d", topic, partition, offset,
                         extra={"task_id": task.id, "queue": task.queue})
        finally:
            for task, *_ in marks:
                self._pending.pop(task.id, None)

    async def _finish(self, poller: threading.Thread) -> None:
        self._stopping = True
        if self._producer is not None:
            await asyncio.to_thread(self._producer.flush, 5.0)
        self._polling.clear()
        await asyncio.to_thread(poller.join, 5.0)
        if self._marking:
            await asyncio.wait(list(self._marking), timeout=5.0)
        if self._next is not None:  # a batch read ahead, not to be sent now: its entries stay in the outbox
            with contextlib.suppress(StoreError):
                await self._next
