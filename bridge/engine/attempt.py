"""One attempt of a claimed task (SPEC §4.3, §4.4): refuse it here if no handler can run it, log its claim first
if it lost a lease before, run the handler, keep the lease alive through the handler's heartbeats.

A running attempt keeps its lease alive only through the handler's heartbeats: a keeper turns recent beats into
lease extensions; when an extension is refused (the lease was reclaimed, a late result finished the task, or a
timeout killed it) the handler is told to abandon (async: cancelled; sync: `heartbeat()` raises LeaseLost). An
abandoned sync handler that returns after all offers its success late (first result wins, SPEC §4.5).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field

from bridge.clock import Clock
from bridge.config import QueueConfig
from bridge.engine.recorder import Recorder
from bridge.engine.runner import RunOutcome, Started, outcome_of, start_handler
from bridge.engine.threads import HandlerThreads
from bridge.handler_api import HandlerContext
from bridge.hooks import Hooks
from bridge.live_config import LiveConfig
from bridge.model import UNROUTABLE, VERSION_MISMATCH, ErrorInfo, Outcome, Task
from bridge.registry import Handler, Registry
from bridge.store.results import Result, RunReport
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)


@dataclass
class Execution:
    task: Task
    ctx: HandlerContext | None = None
    running: Started | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None  # referenced here so the event loop cannot collect it
    started: bool = False  # holds a handler slot (claimed ahead, it may wait for one first)
    recording: bool = False  # the handler returned; its outcome is being written (it holds no slot)
    probe: bool = False  # claimed by a half-open circuit breaker: its outcome decides the breaker
    probe_open: bool = False  # a probe not yet ended: it holds one of the breaker's probe slots
    started_at: int = 0  # when its handler started (ms)


class Attempts:
    def __init__(self, store: Store, registry: Registry, config: LiveConfig, clock: Clock, instance_id: str,
                 threads: HandlerThreads | None, telemetry: Telemetry, hooks: Hooks, recorder: Recorder) -> None:
        self.store = store
        self.registry = registry
        self.config = config
        self.clock = clock
        self.instance_id = instance_id
        self.threads = threads
        self.telemetry = telemetry
        self.hooks = hooks
        self.recorder = recorder
        self._late: set[asyncio.Task[Result]] = set()  # late successes of abandoned sync handlers, being recorded

    async def run(self, execution: Execution) -> RunOutcome | None:
        """Run the claimed task's handler, keeping its lease alive; its outcome, or None when there is nothing to
        record (refused here and dead-lettered, handed back, or its queue removed by a reload)."""
        task = execution.task
        queue = self.config.queue(task.queue)
        started = self.clock.now_ms()
        handler = self.registry.get(task.handler_ref)
        if queue is None:
            return None  # queue removed by a reload: leave the lease to lapse; the task is kept
        refusal = self._refusal(task, handler, queue)
        if refusal is not None:
            report = RunReport(started, self.clock.now_ms(), Outcome.PERMANENT_FAILURE, refusal, self.instance_id)
            await self.recorder.finish_dead(task, report, refusal)
            return None
        assert handler is not None
        # With the changelog (hooks.claim_logged): a task that lost a lease before has its claim in the changelog
        # before its handler runs again (_claim_logged).
        if task.lost_lease and self.hooks.claim_logged is not None and not await self._claim_logged(task, queue):
            return None
        ctx = HandlerContext(task.id, task.queue, task.attempt_count, task.redrive_count, task.payload,
                             task.payload_content_type, task.headers)
        execution.ctx = ctx
        with self.telemetry.attempt_span(task, task.queue, task.attempt_count, task.headers) as span:
            execution.running = start_handler(handler, ctx, self.threads)
            keeper = asyncio.create_task(self._keep_lease(task, ctx, queue, execution.running, started))
            try:
                await asyncio.wait([execution.running.future])
            finally:
                keeper.cancel()
            result = outcome_of(execution.running.future, queue.errors)
            self.telemetry.end_attempt(span, result.outcome, result.error.type if result.error else None)
        self.telemetry.metrics.attempt(task.queue, result.outcome, (self.clock.now_ms() - started) / 1000)
        execution.started_at = started
        return result

    async def _claim_logged(self, task: Task, queue: QueueConfig) -> bool:
        """A task that already lost a lease may be a poison pill that kills the process: its claim goes into the
        changelog before it runs, so that even on a new disk the restore sees the claim, the sweep counts the
        lapse and the pill reaches the DLQ within max_attempts crashes. Not logged within half its lease (the
        broker down?): handed back uncounted, to try again."""
        assert self.hooks.claim_logged is not None
        if await self.hooks.claim_logged(task, queue.lease / 2):
            return True
        log.warning("its claim could not be logged in time; handed back", extra={"task_id": task.id,
                                                                                "queue": task.queue})
        await self.store.release(task.id, task.lease_token, self.clock.now_ms())
        return False

    def _refusal(self, task: Task, handler: Handler | None, queue: QueueConfig) -> ErrorInfo | None:
        """Why the task must not run here at all: no such handler, or a version pin this handler does not meet.

        A pin is met only by a handler registered with that very version: one registered without a version
        cannot prove it runs the pinned code, so under `dead-letter` it is a mismatch too (`run-latest` runs it).
        A task without a pin runs on whatever is registered."""
        if handler is None:
            return ErrorInfo(UNROUTABLE, f"no handler registered as {task.handler_ref!r} on {self.instance_id}")
        if (task.handler_version is not None and task.handler_version != handler.version
                and queue.version_mismatch == "dead-letter"):
            registered = handler.version or "registered without a version"
            return ErrorInfo(VERSION_MISMATCH, f"task pinned to {task.handler_ref}@{task.handler_version}, "
                                               f"registered version is {registered}")
        return None

    async def _keep_lease(self, task: Task, ctx: HandlerContext, queue: QueueConfig, running: Started,
                          started: int) -> None:
        """Every heartbeat interval: extend the lease if the handler beat since the last check. A handler that
        stays silent until its lease lapses is abandoned too: its slot must not be held by a hung handler."""
        checked = ctx.last_beat
        expires = task.lease_expires_at or self.clock.now_ms() + int(queue.lease * 1000)
        while not running.future.done():
            await asyncio.sleep(queue.heartbeat_interval)
            now = self.clock.now_ms()
            if ctx.last_beat == checked:
                if now < expires:
                    continue
                lost = True  # silent past its lease: the sweep reclaims the task (LEASE_EXPIRED)
            else:
                checked = ctx.last_beat
                lost = not await self.store.extend_lease(task.id, task.lease_token, queue.lease, now)
                expires = now + int(queue.lease * 1000)
            if lost:
                log.warning("lease lost; abandoning the attempt", extra={"task_id": task.id, "queue": task.queue})
                ctx.lose_lease()  # a sync handler learns at its next heartbeat()
                running.abandon(functools.partial(asyncio.get_running_loop().call_soon_threadsafe,
                                                  self._late_success, task, started))
                return

    def _late_success(self, task: Task, started: int) -> None:
        """An abandoned sync handler returned after all: offer its success to the store under its own token.
        Accepted while the task is not terminal (first result wins, SPEC §4.5); refused otherwise."""
        queue = self.config.queue(task.queue)
        if queue is None:
            return
        recording = asyncio.ensure_future(self.recorder.record(task, queue, started, RunOutcome(Outcome.SUCCESS)))
        self._late.add(recording)
        recording.add_done_callback(self._late_recorded)

    def _late_recorded(self, recording: asyncio.Task[Result]) -> None:
        self._late.discard(recording)
        if not recording.cancelled() and recording.exception() is not None:
            log.error("could not record a late success: %s", recording.exception())
