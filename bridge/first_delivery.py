"""First delivery (SPEC §4.1): run the handler inline on a source record; a failure becomes a stored task.

`handle()` returns only once the record is done: it succeeded, or its task is durably stored. A store that
cannot be written is retried (with the consumer paused through `on_store_health`): the record is never dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from bridge.clock import Clock
from bridge.config import QueueConfig
from bridge.handler_api import HandlerContext
from bridge.live_config import LiveConfig
from bridge.model import LEASE_EXPIRED, TIMEOUT, UNROUTABLE, Attempt, ErrorInfo, NewTask, Outcome, Status, new_task_id
from bridge.policy import decide
from bridge.records import SourceRecord
from bridge.registry import Registry
from bridge.runner import RunOutcome, Started, outcome_of, start_handler
from bridge.store import Store, StoreError
from bridge.telemetry import Telemetry
from bridge.threads import HandlerThreads

log = logging.getLogger(__name__)
_STORE_RETRY_MAX = 5.0


@dataclass(frozen=True)
class Stored:
    """A first delivery's failure, stored: the task's status and id (the id the changelog is awaited on)."""

    status: Status
    task_id: str


class FirstDelivery:
    def __init__(self, store: Store, config: LiveConfig, registry: Registry, clock: Clock,
                 threads: HandlerThreads | None, worker: str, on_dead: Callable[[str], None] | None = None,
                 on_store_health: Callable[[bool], None] | None = None, telemetry: Telemetry | None = None,
                 on_pending: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.config = config
        self.registry = registry
        self.clock = clock
        self.threads = threads
        self.worker = worker
        self.on_dead = on_dead
        self.on_store_health = on_store_health
        self.on_pending = on_pending  # a new PENDING task: the scheduler (or a waiting remote claim) looks now
        self.telemetry = telemetry or Telemetry()

    async def handle(self, record: SourceRecord, queue_name: str, suspect: bool = False) -> Status | None:
        """Done when this returns. Returns the status of the stored task, or None on success."""
        stored = await self.handle_record(record, queue_name, suspect)
        return None if stored is None else stored.status

    async def handle_record(self, record: SourceRecord, queue_name: str, suspect: bool = False) -> Stored | None:
        """Done (succeeded, or its task durably in the store) when this returns; None on success."""
        queue = self.config.queue(queue_name)
        headers = record.task_headers()
        self.telemetry.metrics.record_seen(queue_name)  # every record, however it is handled
        if queue is None:
            reason = ErrorInfo(UNROUTABLE, f"topic {record.topic} has no queue in the configuration")
            return await self._store(self._dead_task(record, queue_name, "", headers, reason, None))
        if suspect:
            return await self._store(self._crashed_task(record, queue_name, queue, headers))
        if queue.remote:
            # The handler lives in remote workers: the record becomes a task due now, for them to claim.
            return await self._store(NewTask(
                queue=queue_name, handler_ref=queue.handler, payload=record.value, headers=headers,
                status=Status.PENDING, created_at=self.clock.now_ms(), first_attempt=None,
                next_attempt_at=self.clock.now_ms(), payload_content_type=record.content_type))
        handler = self.registry.get(queue.handler)
        if handler is None:
            reason = ErrorInfo(UNROUTABLE, f"no handler registered as {queue.handler!r} on {self.worker}")
            return await self._store(self._dead_task(record, queue_name, queue.handler, headers, reason, None))
        # The task id is made only if used: read by the handler (to dedupe), or for a failure's task.
        ctx = HandlerContext(new_task_id, queue_name, 1, 0, record.value, record.content_type, headers)
        telemetry = self.telemetry
        with telemetry.consume_span(record, queue_name, headers):
            started = self.clock.now_ms()
            with telemetry.attempt_span(ctx, queue_name, 1, headers, inline=True) as span:
                running = start_handler(handler, ctx, self.threads)
                ended = await self._within_lease(running, ctx, queue.lease, queue.queue_timeout)
                if ended == "done":
                    result = outcome_of(running.future, queue.errors)
                elif ended == "silent":
                    result = RunOutcome(Outcome.LEASE_EXPIRED, ErrorInfo(
                        LEASE_EXPIRED, f"first delivery ran a whole lease ({queue.lease:g}s) without a heartbeat; "
                                       "abandoned and handed to the scheduler"))
                else:  # heartbeating past the queue timeout: the whole-life bound ends it (SPEC 4.6)
                    result = RunOutcome(Outcome.PERMANENT_FAILURE, ErrorInfo(
                        TIMEOUT, f"first delivery still running after queue_timeout ({queue.queue_timeout:g}s)"))
                telemetry.end_attempt(span, result.outcome, result.error.type if result.error else None)
            telemetry.metrics.attempt(queue_name, result.outcome, (self.clock.now_ms() - started) / 1000)
            if result.ok:
                return None
            return await self._store(self._failed_task(record, queue_name, queue, headers, ctx.task_id,
                                                       handler.version, started, result))

    @staticmethod
    async def _within_lease(running: Started, ctx: HandlerContext, lease: float,
                            queue_timeout: float | None) -> str:
        """Wait for the handler while it heartbeats at least once per lease, within the queue timeout.
        "done"; "silent": no heartbeat for a whole lease (hung); "timeout": past queue_timeout. Silent or timed
        out, it is abandoned, so one stuck record cannot hold its partition's slot forever."""
        began = time.monotonic()
        while True:
            done, _ = await asyncio.wait([running.future], timeout=lease)
            if done:
                return "done"
            now = time.monotonic()
            if queue_timeout is not None and now - began >= queue_timeout:
                ended = "timeout"
            elif now - ctx.last_beat >= lease:
                ended = "silent"
            else:
                continue
            ctx.lose_lease()  # a sync handler learns at its next heartbeat()
            # An async one stops now; a sync one's thread is counted stuck until it returns. Its success, if it
            # comes, is not recorded: the record's task was never claimed, so it has no fencing token to carry.
            running.abandon()
            return ended

    def _failed_task(self, record: SourceRecord, queue_name: str, queue: QueueConfig, headers: dict[str, str],
                     task_id: str, version: str | None, started: int, result: RunOutcome) -> NewTask:
        now = self.clock.now_ms()
        assert result.error is not None
        attempt = Attempt(1, 0, started, now, result.outcome, result.error, self.worker)
        decision = decide(queue, result.outcome, 1, result.requested_delay)
        dead = decision.retry_after is None
        return NewTask(
            queue=queue_name, handler_ref=queue.handler, payload=record.value, headers=headers,
            status=Status.DEAD if dead else Status.PENDING, created_at=now, first_attempt=attempt,
            next_attempt_at=None if dead else now + int(decision.retry_after * 1000),  # type: ignore[operator]
            dead_reason=result.error if dead else None, handler_version=version,
            payload_content_type=record.content_type, id=task_id,
        )  # fmt: skip

    def _crashed_task(self, record: SourceRecord, queue_name: str, queue: QueueConfig,
                      headers: dict[str, str]) -> NewTask:
        """The bridge died while this record's first delivery ran: attempt 1 is LEASE_EXPIRED (poison pill)."""
        error = ErrorInfo(LEASE_EXPIRED, "the bridge stopped while this record's first delivery was running")
        handler = self.registry.get(queue.handler)
        return self._failed_task(record, queue_name, queue, headers, new_task_id(),
                                 handler.version if handler else None, self.clock.now_ms(),
                                 RunOutcome(Outcome.LEASE_EXPIRED, error))

    def _dead_task(self, record: SourceRecord, queue_name: str, handler_ref: str, headers: dict[str, str],
                   reason: ErrorInfo, attempt: Attempt | None) -> NewTask:
        return NewTask(queue=queue_name, handler_ref=handler_ref, payload=record.value, headers=headers,
                       status=Status.DEAD, created_at=self.clock.now_ms(), first_attempt=attempt, dead_reason=reason,
                       payload_content_type=record.content_type)

    async def _store(self, task: NewTask) -> Stored:
        """Store until it is durable. While the store fails, the consumer is paused; the record is never dropped."""
        delay = 0.05
        while True:
            try:
                await self.store.submit(task)
                break
            except StoreError as e:
                log.error("cannot store a failed record (retrying; consumption paused): %s", e,
                          extra={"task_id": task.id, "queue": task.queue})
                if self.on_store_health:
                    self.on_store_health(False)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _STORE_RETRY_MAX)
        if self.on_store_health:
            self.on_store_health(True)
        metrics = self.telemetry.metrics
        metrics.tasks_created.labels(task.queue, task.status.value).inc()
        if task.status == Status.DEAD:
            assert task.dead_reason is not None
            metrics.dead_of(task.queue, task.dead_reason.type)
            if self.on_dead:
                self.on_dead(task.queue)
        elif self.on_pending:
            self.on_pending(task.queue)
        return Stored(task.status, task.id)
