"""First delivery (SPEC §4.1): run the handler inline on a source record; a failure becomes a stored task.

The per-record work is split so that a partition's lane (bridge/lanes.py) can run many records in one executor
hop: `prepare` (a record that becomes a task without running — no queue, a suspect, a remote queue, no handler —
or one whose handler is to run), `run_sync` / `run_async` (the handler, under its spans when the record is
sampled), `ended` / `abandoned` (what the attempt became, as a `Ran`), and `store_all` (the failures of a batch,
durably: one group commit). `handle_record` does all of it for one record, with the classic per-record watchdog.

A record is done when its `Ran` is a success or its task is durably stored. A store that cannot be written is
retried (with the consumer paused through the `store_health` hook): the record is never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, cast

from bridge.aio import Backoff
from bridge.clock import Clock
from bridge.config import QueueConfig
from bridge.engine.policy import backoff_delay, decide
from bridge.engine.runner import SUCCESS, RunOutcome, outcome_of_exception
from bridge.engine.threads import HandlerThreads
from bridge.handler_api import HandlerContext
from bridge.hooks import Hooks
from bridge.live_config import LiveConfig
from bridge.model import (
    LEASE_EXPIRED,
    TIMEOUT,
    UNROUTABLE,
    Attempt,
    ErrorInfo,
    NewTask,
    Outcome,
    Status,
    new_task_id,
    order_key_of,
)
from bridge.records import Fetched, SourceRecord, TaskHeaders, content_type_of
from bridge.registry import Handler, Registry
from bridge.source.ends import Begun, Plan, Ran, Results, Stored
from bridge.store.database import StoreError
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)
_STORE_RETRY_MAX = 5.0
SUSPECT_NOTE = ("in flight when its bridge stopped, maybe never begun: not counted against max_attempts (it would "
                "have been the last)")


def order_fields(record: SourceRecord, queue: QueueConfig) -> dict[str, Any]:
    """A record's place in its key's order (ordering: key)."""
    return {"order_key": order_key_of(record.topic, record.partition, record.key), "order_seq": record.offset,
            "order_hold": queue.on_dead == "hold"}


def ordered(task: NewTask, record: SourceRecord, queue: QueueConfig) -> NewTask:
    """A first delivery's task with its place in its key's order (ordering: key; a record without a key has none:
    each is its own key)."""
    if queue.ordering != "key" or record.key is None:
        return task
    return dataclasses.replace(task, **order_fields(record, queue))


class FirstDelivery:
    def __init__(self, store: Store, config: LiveConfig, registry: Registry, clock: Clock,
                 threads: HandlerThreads | None, worker: str, hooks: Hooks | None = None,
                 telemetry: Telemetry | None = None) -> None:
        self.store = store
        self.config = config
        self.registry = registry
        self.clock = clock
        self.threads = threads
        self.worker = worker
        # Told: a task went DEAD or PENDING, the first attempts' outcomes (the breaker), the store's health.
        self.hooks = hooks or Hooks()
        self.telemetry = telemetry or Telemetry()
        self._is_async: dict[str, bool] = {}

    # ---- one record, start to end (tests, tools; the consumer uses lanes) -------------------------------

    async def handle(self, record: SourceRecord, queue_name: str, suspect: bool = False) -> Status | None:
        """Done when this returns. Returns the status of the stored task, or None on success."""
        stored = await self.handle_record(record, queue_name, suspect)
        return None if stored is None else stored.status

    async def handle_record(self, record: SourceRecord, queue_name: str, suspect: bool = False) -> Stored | None:
        """Done (succeeded, or its task durably in the store) when this returns; None on success."""
        self.telemetry.metrics.record_seen(queue_name)  # every record, however it is handled
        prepared = self.prepare(record, queue_name, suspect)
        if isinstance(prepared, Begun):
            ran = await self._run_watched(prepared)
            self.count(queue_name, [ran])
            task = ran.task
            if task is None:
                return None
        else:
            task = prepared
        return (await self.store_all([task]))[0]

    async def _run_watched(self, begun: Begun) -> Ran:
        """Run one handler while it heartbeats at least once per lease, within the queue timeout."""
        if self.is_async(begun.handler):
            future: asyncio.Future[Ran] = asyncio.ensure_future(self.run_async(begun))
            call = pool = None
        else:
            assert self.threads is not None
            pool = self.threads.pool(begun.queue_name)
            call = pool.submit(functools.partial(self.run_sync, begun))
            future = asyncio.wrap_future(call)
        while True:
            done, _ = await asyncio.wait([future], timeout=begun.queue.lease)
            if done:
                return future.result()
            why = begun.overdue(time.monotonic())
            if why is not None:
                begun.ctx.lose_lease()  # a sync handler learns at its next heartbeat()
                future.cancel()
                if call is not None and pool is not None:
                    pool.abandon(call)  # its thread is counted stuck until it returns
                return self.abandoned(begun, why)

    # ---- the pieces a lane runs ---------------------------------------------------------------------------

    def is_async(self, handler: Handler) -> bool:
        known = self._is_async.get(handler.name)
        if known is None:
            known = self._is_async[handler.name] = handler.is_async
        return known

    def runs_on_loop(self, queue_name: str) -> bool:
        """A queue whose records need no thread: an async handler, or none here (remote, unregistered)."""
        queue = self.config.queue(queue_name)
        if queue is None or queue.remote:
            return True
        handler = self.registry.get(queue.handler)
        return handler is None or self.is_async(handler)

    def prepare(self, record: SourceRecord, queue_name: str, suspect: bool = False) -> Begun | NewTask:
        """What a record needs: its handler run (a `Begun`, for `run_sync` / `run_async`), or a task at once — no
        queue for its topic, a suspect (the bridge died while it ran), a remote queue, no handler here."""
        queue = self.config.queue(queue_name)
        if queue is None:
            reason = ErrorInfo(UNROUTABLE, f"topic {record.topic} has no queue in the configuration")
            return self._dead_task(record, queue_name, "", reason)
        if queue.remote:
            # The handler lives in remote workers: the record becomes a task due now, for them to claim (with
            # ordering: key, parked behind its key's open task; the store makes it due when there is none).
            if queue.ordering == "key" and record.key is not None:
                return self.parked(record, queue_name, queue)
            now = self.clock.now_ms()
            return NewTask(queue=queue_name, handler_ref=queue.handler, payload=record.value,
                           headers=record.task_headers(), status=Status.PENDING, created_at=now, first_attempt=None,
                           next_attempt_at=now, payload_content_type=record.content_type)
        if suspect:  # (a remote queue's record never runs here: after a crash it is stored as it would have been)
            handler = self.registry.get(queue.handler)
            task = suspect_task(record, queue_name, queue, handler.version if handler else None, self.worker,
                                self.clock.now_ms())
            return ordered(task, record, queue)
        handler = self.registry.get(queue.handler)
        if handler is None:
            reason = ErrorInfo(UNROUTABLE, f"no handler registered as {queue.handler!r} on {self.worker}")
            return ordered(self._dead_task(record, queue_name, queue.handler, reason), record, queue)
        telemetry = self.telemetry
        sampled = telemetry.tracing and telemetry.sample(record)
        # Untraced here, a record without a traceparent still gets a sampled one (downstream may trace it).
        headers = TaskHeaders(record, sampled or not telemetry.tracing)
        # The task id is made only if used: read by the handler (to dedupe), or for a failure's task.
        ctx = HandlerContext(new_task_id, queue_name, 1, 0, record.value, record.content_type, headers)
        return Begun(record, queue_name, queue, handler, ctx, self.clock.now_ms(), ctx.last_beat, sampled)

    def plan(self, queue_name: str, run_async: bool = False) -> Plan | None:
        """The common path's constants for a runner's records, or None: each record goes `prepare`'s way (no
        queue, a remote one, no handler here, tracing on, or a handler not of the runner's kind: a sync runner
        plans sync handlers, an async one, `run_async`, async handlers)."""
        if self.telemetry.tracing:
            return None
        queue = self.config.queue(queue_name)
        if queue is None or queue.remote:
            return None
        handler = self.registry.get(queue.handler)
        if handler is None or self.is_async(handler) != run_async:
            return None
        return Plan(queue_name, queue, handler)

    @staticmethod
    def begin(plan: Plan, record: Fetched) -> Begun:
        """`prepare` for a fetched record of a planned chunk (not a suspect: the runner asked). No SourceRecord, and
        no wall-clock read: both are made only if it fails (`ended`)."""
        ctx = HandlerContext(new_task_id, plan.queue_name, 1, 0, record.value() or b"",
                             content_type_of(record.headers()), TaskHeaders(record, True))
        return Begun(record, plan.queue_name, plan.queue, plan.handler, ctx, None, ctx.last_beat, False)

    def run_sync(self, begun: Begun) -> Ran:
        """Run a sync handler here (a handler thread) and say what it became. Never raises."""
        if not begun.sampled:  # the common case, inline: a fast handler's record is a few microseconds
            try:
                begun.handler.fn(begun.ctx)
            except Exception as e:
                return self.ended(begun, outcome_of_exception(e, begun.queue.errors))
            return Ran(begun.source_record(), begun.queue_name, None, Outcome.SUCCESS,
                       time.monotonic() - begun.began)
        with self._spans(begun) as span:
            result = self._call_sync(begun)
            self._end_span(span, begun, result)
        return self.ended(begun, result)

    async def run_async(self, begun: Begun) -> Ran:
        """Run an async handler and say what it became. Never raises but CancelledError (abandoned)."""
        if not begun.sampled:
            try:
                await begun.handler.fn(begun.ctx)  # type: ignore[misc]
            except Exception as e:
                return self.ended(begun, outcome_of_exception(e, begun.queue.errors))
            return Ran(begun.source_record(), begun.queue_name, None, Outcome.SUCCESS,
                       time.monotonic() - begun.began)
        with self._spans(begun) as span:
            result = await self._call_async(begun)
            self._end_span(span, begun, result)
        return self.ended(begun, result)

    @staticmethod
    def _call_sync(begun: Begun) -> RunOutcome:
        try:
            begun.handler.fn(begun.ctx)
            return SUCCESS
        except Exception as e:  # the handler's error is its outcome
            return outcome_of_exception(e, begun.queue.errors)

    @staticmethod
    async def _call_async(begun: Begun) -> RunOutcome:
        try:
            await begun.handler.fn(begun.ctx)  # type: ignore[misc]
            return SUCCESS
        except Exception as e:
            return outcome_of_exception(e, begun.queue.errors)

    @contextlib.contextmanager
    def _spans(self, begun: Begun) -> Iterator[Any]:
        """The consume span and the attempt span under it (a sampled record's)."""
        telemetry, headers = self.telemetry, begun.ctx.headers
        with telemetry.consume_span(begun.source_record(), begun.queue_name, headers), \
                telemetry.attempt_span(begun.ctx, begun.queue_name, 1, headers, inline=True) as span:
            yield span

    def _end_span(self, span: Any, begun: Begun, result: RunOutcome) -> None:
        if span is not None:
            self.telemetry.end_attempt(span, result.outcome, result.error.type if result.error else None,
                                       None if result.ok else begun.ctx.task_id)

    def abandoned(self, begun: Begun, why: str) -> Ran:
        """A handler given up on (`overdue`). An async one is cancelled; a sync one's thread is counted stuck
        until it returns. Its success, if it comes, is not recorded: the record's task was never claimed, so it
        has no fencing token to carry (the task runs again: at-least-once)."""
        begun.ctx.lose_lease()  # a sync handler learns at its next heartbeat()
        if why == "timeout":
            result = RunOutcome(Outcome.PERMANENT_FAILURE, ErrorInfo(
                TIMEOUT, f"first delivery still running after queue_timeout ({begun.queue.queue_timeout:g}s)"))
        else:
            result = RunOutcome(Outcome.LEASE_EXPIRED, ErrorInfo(
                LEASE_EXPIRED, f"first delivery ran a whole lease ({begun.queue.lease:g}s) without a heartbeat; "
                               "abandoned and handed to the scheduler"))
        return self.ended(begun, result)

    def ended(self, begun: Begun, result: RunOutcome) -> Ran:
        seconds = time.monotonic() - begun.began
        record = begun.source_record()
        if result.ok:
            return Ran(record, begun.queue_name, None, result.outcome, seconds)
        started = begun.started_ms
        if started is None:  # a planned record's: its start by the wall clock, from how long it ran
            started = self.clock.now_ms() - int(seconds * 1000)
        task = self._failed_task(record, begun.queue_name, begun.queue, begun.ctx.headers, begun.ctx.task_id,
                                 begun.handler.version, started, result)
        return Ran(record, begun.queue_name, ordered(task, record, begun.queue), result.outcome, seconds)

    def parked(self, record: SourceRecord, queue_name: str, queue: QueueConfig) -> NewTask:
        """A record of a key held back by an open task (ordering: key): stored PARKED behind it, its handler not
        run, no attempt spent (SPEC §12). The store makes it PENDING, due now, if the key has no open task by
        then."""
        return NewTask(queue=queue_name, handler_ref=queue.handler, payload=record.value,
                       headers=record.task_headers(), status=Status.PARKED, created_at=self.clock.now_ms(),
                       first_attempt=None, payload_content_type=record.content_type, **order_fields(record, queue))

    def count(self, queue_name: str, results: list[Ran] | Results) -> None:
        """The attempt metrics of a batch of results (one lock, not one per record)."""
        if isinstance(results, Results):
            ran = [r for r in results.ran if r.outcome is not None]
            oks = results.ok_seconds
        else:
            ran, oks = [r for r in results if r.outcome is not None], []
        if ran or oks:
            outcomes = cast(list[Outcome], [r.outcome for r in ran])  # not None: filtered just above
            self.telemetry.metrics.attempts.add_many(queue_name, outcomes, [r.seconds for r in ran] + oks, len(oks))
            if self.hooks.first_attempts:
                self.hooks.first_attempts(queue_name, outcomes, len(oks))

    # ---- the tasks records become --------------------------------------------------------------------

    def _failed_task(self, record: SourceRecord, queue_name: str, queue: QueueConfig, headers: Mapping[str, str],
                     task_id: str, version: str | None, started: int, result: RunOutcome) -> NewTask:
        now = self.clock.now_ms()
        assert result.error is not None
        attempt = Attempt(1, 0, started, now, result.outcome, result.error, self.worker)
        decision = decide(queue, result.outcome, 1, result.requested_delay)
        dead = decision.retry_after is None
        return NewTask(
            queue=queue_name, handler_ref=queue.handler, payload=record.value,
            headers=headers.made() if isinstance(headers, TaskHeaders) else dict(headers),
            status=Status.DEAD if dead else Status.PENDING, created_at=now, first_attempt=attempt,
            next_attempt_at=None if dead else now + int(decision.retry_after * 1000),  # type: ignore[operator]
            dead_reason=result.error if dead else None, handler_version=version,
            payload_content_type=record.content_type, id=task_id,
        )  # fmt: skip

    def _dead_task(self, record: SourceRecord, queue_name: str, handler_ref: str, reason: ErrorInfo) -> NewTask:
        return NewTask(queue=queue_name, handler_ref=handler_ref, payload=record.value, headers=record.task_headers(),
                       status=Status.DEAD, created_at=self.clock.now_ms(), first_attempt=None, dead_reason=reason,
                       payload_content_type=record.content_type)

    # ---- storing --------------------------------------------------------------------------------------

    async def store_all(self, tasks: list[NewTask]) -> list[Stored]:
        """Store a batch of failures until every one is durable (submitted together: they share group commits).
        Those the store refuses are retried with backoff while the consumer is paused; none is ever dropped."""
        waiting = list(tasks)
        backoff = Backoff(0.05, _STORE_RETRY_MAX)
        while True:
            try:
                errors: list[StoreError | None] = await self.store.submit_many(
                    waiting, functools.partial(self._due_queued, waiting))
            except StoreError as e:  # the store is closed
                errors = [e] * len(waiting)
            failed = [(task, error) for task, error in zip(waiting, errors, strict=True) if error is not None]
            for task, error in failed[:1]:
                log.error("cannot store %d failed records (retrying; consumption paused): %s", len(failed), error,
                          extra={"task_id": task.id, "queue": task.queue})
            if not failed:
                break
            self.hooks.store_health(False)
            await backoff.sleep()
            waiting = [task for task, _ in failed]
        self.hooks.store_health(True)
        for task in tasks:
            self._stored(task)
        return [Stored(task.status, task.id) for task in tasks]

    def _due_queued(self, tasks: list[NewTask]) -> None:
        """The tasks are queued for the store's next commit: the scheduler may claim those due now behind them,
        in the same transaction (a zero-backoff retry then costs no commit of its own)."""
        now = self.clock.now_ms()
        due = Counter(t.queue for t in tasks if t.status == Status.PENDING and (t.next_attempt_at or 0) <= now)
        for queue, count in due.items():
            self.hooks.due_tasks_queued(queue, count)

    def _stored(self, task: NewTask) -> None:
        metrics = self.telemetry.metrics
        metrics.tasks_created.labels(task.queue, task.status.value).inc()
        if task.status == Status.DEAD:
            assert task.dead_reason is not None
            metrics.dead_of(task.queue, task.dead_reason.type)
            self.hooks.task_dead(task.queue)
        elif not (self.hooks.due_tasks_queued and due_from_creation(task)):
            self.hooks.task_pending(task.queue)  # not announced to `due_tasks_queued` (whose subscriber wakes)


def due_from_creation(task: NewTask) -> bool:
    """Due when created: announced to `due_tasks_queued` whenever it was queued for the store (`_due_queued`);
    its subscriber claimed it behind the insert, or woke whoever claims it."""
    return (task.next_attempt_at or 0) <= task.created_at


def suspect_task(record: SourceRecord, queue_name: str, queue: QueueConfig, handler_version: str | None,
                 worker: str, now: int) -> NewTask:
    """The bridge died while this record was in flight: attempt 1 is LEASE_EXPIRED (how a poison pill that kills
    its bridge is counted). The journal holds a poll's range, not the records that began: this one may never have
    run. So the attempt is counted only if attempts remain after it; where it would be the last (max_attempts 1)
    it stays in the history uncounted and the task is retried: no record is dead-lettered without one run that
    surely began (a claim is logged before its handler runs)."""
    error = ErrorInfo(LEASE_EXPIRED, "the bridge stopped while this record's first delivery was in flight")
    counted = queue.max_attempts > 1
    attempt = Attempt(1, 0, now, now, Outcome.LEASE_EXPIRED, error, worker, note=None if counted else SUSPECT_NOTE)
    return NewTask(queue=queue_name, handler_ref=queue.handler, payload=record.value, headers=record.task_headers(),
                   status=Status.PENDING, created_at=now, first_attempt=attempt,
                   next_attempt_at=now + int(backoff_delay(queue.backoff, 1) * 1000), handler_version=handler_version,
                   payload_content_type=record.content_type, first_attempt_counted=counted)
