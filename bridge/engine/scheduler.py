"""The scheduler: per-queue concurrency; claim due tasks under a lease, run the handler, record the outcome.

A running attempt keeps its lease alive only through the handler's heartbeats: a keeper turns recent beats
into lease extensions; when an extension is refused (the lease was reclaimed, a late result finished the task,
or a timeout killed it) the handler is told to abandon (async: cancelled; sync: `heartbeat()` raises LeaseLost).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from bridge.aio import first_of
from bridge.clock import Clock
from bridge.config import QueueConfig
from bridge.engine.breaker import Breaker, Breakers, State
from bridge.engine.policy import decide
from bridge.engine.runner import RunOutcome, Started, outcome_of, start_handler
from bridge.engine.threads import HandlerThreads
from bridge.handler_api import HandlerContext
from bridge.hooks import Hooks
from bridge.live_config import LiveConfig
from bridge.model import UNROUTABLE, VERSION_MISMATCH, ErrorInfo, Outcome, Task
from bridge.registry import Handler, Registry
from bridge.store.database import StoreError
from bridge.store.results import Result, RunReport
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)
_MAX_IDLE = 1.0


PROBE_NOTE = "a circuit-breaker probe during an outage: not counted against max_attempts"


@dataclass
class _Execution:
    task: Task
    ctx: HandlerContext | None = None
    running: Started | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None  # referenced here so the event loop cannot collect it
    started: bool = False  # holds a handler slot (claimed ahead, it may wait for one first)
    recording: bool = False  # the handler returned; its outcome is being written (it holds no slot)
    probe: bool = False  # claimed by a half-open circuit breaker: its outcome decides the breaker
    probe_open: bool = False  # a probe not yet ended: it holds one of the breaker's probe slots


class Scheduler:
    def __init__(self, store: Store, registry: Registry, config: LiveConfig, clock: Clock, instance_id: str,
                 threads: HandlerThreads | None = None, on_dead: Callable[[Task], None] | None = None,
                 rand: Callable[[], float] = random.random, telemetry: Telemetry | None = None,
                 breakers: Breakers | None = None, hooks: Hooks | None = None) -> None:
        self.store = store
        self.registry = registry
        self.config = config
        self.clock = clock
        self.instance_id = instance_id
        self.threads = threads
        self.on_dead = on_dead
        self.hooks = hooks or Hooks()
        self.rand = rand
        self.telemetry = telemetry or Telemetry()
        self.paused: set[str] = set()  # by an operator (admin `pause`)
        self.breakers = breakers or Breakers(config, clock, self.telemetry.metrics)
        self.breakers.on_change.append(lambda transition: self.wake(transition.queue))
        self._running: dict[str, _Execution] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._slot_freed: dict[str, asyncio.Event] = {}  # for the claim loop's idle wait
        self._slot_open: dict[str, asyncio.Event] = {}  # for tasks claimed ahead, waiting for a slot (one-shot)
        self._late: set[asyncio.Task[Result]] = set()  # late successes of abandoned sync handlers, being recorded
        self._stopping = False

    # ---- the loop --------------------------------------------------------------------------------------

    def held_queues(self) -> set[str]:
        """Queues whose source partitions stay paused: by an operator, or by an open (or probing) breaker. The
        queue runs only when neither holds it."""
        return self.paused | self.breakers.holding()

    def _limit(self, queue: QueueConfig, name: str) -> int:
        """How many of the queue's retries may run now (its breaker may hold some or all of them back)."""
        return self.breakers.of(name).concurrency(queue.concurrency)

    def wake(self, queue: str) -> None:
        """A task in `queue` may be due now (a new failure, a redrive): look again without waiting."""
        self.wake_event(queue).set()

    def wake_event(self, queue: str) -> asyncio.Event:
        return self._wake.setdefault(queue, asyncio.Event())

    def running_count(self, queue: str | None = None) -> int:
        """Handlers running (the slots `concurrency` bounds): an attempt whose outcome is being written no longer
        holds one — a retry waits for a handler slot, not for another task's fsync."""
        return sum(1 for e in self._running.values()
                   if e.started and not e.recording and (queue is None or e.task.queue == queue))

    def _waiting_count(self, queue: str) -> int:
        """Tasks claimed ahead of a slot (see `run_once`)."""
        return sum(1 for e in self._running.values() if not e.started and e.task.queue == queue)

    def _free_slot(self, queue: str) -> None:
        self._slot_freed.setdefault(queue, asyncio.Event()).set()
        opened = self._slot_open.pop(queue, None)
        if opened is not None:
            opened.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Claim and run until `stop`; one loop per configured queue (queues added by a reload join)."""
        loops: dict[str, asyncio.Task[None]] = {}
        while not stop.is_set():
            for name in self.config.queue_names():
                queue = self.config.queue(name)
                if queue is None or queue.remote:
                    continue  # remote workers claim these over their socket
                if name not in loops or loops[name].done():
                    loops[name] = asyncio.create_task(self._queue_loop(name, stop), name=f"rdq-queue-{name}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _MAX_IDLE)
        for name in loops:
            self.wake(name)
        await asyncio.gather(*loops.values(), return_exceptions=True)

    async def _queue_loop(self, name: str, stop: asyncio.Event) -> None:
        wake = self._wake.setdefault(name, asyncio.Event())
        while not stop.is_set():
            queue = self.config.queue(name)
            if queue is None:
                return  # removed by a reload; tasks already running finish on their own
            wake.clear()
            claimed = 0
            if name not in self.paused:
                try:
                    claimed = await self.run_once(name)
                except StoreError as e:
                    log.error("claim failed: %s", e, extra={"queue": name})
            if claimed == 0 or self._waiting_count(name) >= queue.concurrency:
                await self._idle(name, queue, wake, stop)

    def _holding(self, name: str, queue: QueueConfig) -> bool:
        """Nothing of this queue may be claimed now, whatever is due: paused by an operator, its breaker open, or
        half-open with every probe out. (A wake-up — resume, a breaker's change — ends the wait.)"""
        breaker = self.breakers.of(name)
        probing = breaker.state == State.HALF_OPEN
        return (name in self.paused or self._limit(queue, name) == 0
                or (probing and breaker.probes_out >= breaker.config.probes))

    async def _idle(self, name: str, queue: QueueConfig, wake: asyncio.Event, stop: asyncio.Event) -> None:
        """Sleep until a slot frees (when full), the next task is due, a wake-up, or stop: whichever is first."""
        events = [wake, stop]
        timeout = _MAX_IDLE
        limit = self._limit(queue, name)
        full = self.running_count(name) + self._waiting_count(name) >= 2 * limit > 0
        if self._waiting_count(name) >= queue.concurrency or full:
            freed = self._slot_freed.setdefault(name, asyncio.Event())
            freed.clear()
            events.append(freed)
        elif self._holding(name, queue):
            pass  # due tasks wait: looking at their due time again would only spin
        else:
            next_due = await self.store.next_due_at(name)
            if next_due is not None:
                timeout = min(_MAX_IDLE, max(0.0, (next_due - self.clock.now_ms()) / 1000))
        if timeout <= 0:
            return
        await first_of(*events, timeout=timeout)

    async def run_once(self, name: str) -> int:
        """Claim due tasks for the free slots and as many again ahead of them, and start them. Returns how many
        were claimed. Claiming ahead overlaps a claim's group commit with the handlers running: claiming only for
        the slots free when the claim began, a queue of fast handlers ran at one claim's worth per commit."""
        queue = self.config.queue(name)
        if queue is None or self._stopping:
            return 0
        breaker = self.breakers.of(name)
        if breaker.state == State.HALF_OPEN:
            return await self._probe(name, queue, breaker)
        limit = self._limit(queue, name)
        free = 2 * limit - self.running_count(name) - self._waiting_count(name)
        handler = self.registry.get(queue.handler)
        if handler is not None and not handler.is_async and self.threads is not None:
            free = min(free, 2 * self.threads.pool(name).free())  # hung sync handlers hold threads: claim no more
        if free <= 0:
            return 0
        return self._start(await self.store.claim_due(name, free, queue.lease, self.instance_id,
                                                      self.clock.now_ms()))

    async def _probe(self, name: str, queue: QueueConfig, breaker: Breaker) -> int:
        """Half-open: claim the probes (the tasks due first), no more; with none waiting at all, close."""
        free = breaker.config.probes - breaker.probes_out
        if free <= 0:
            return 0
        tasks = await self.store.claim_due(name, free, queue.lease, self.instance_id, self.clock.now_ms())
        if not tasks:
            if await self.store.next_due_at(name) is None:
                self.breakers.report(breaker.nothing_to_probe())
            return 0
        breaker.probes_out += len(tasks)
        return self._start(tasks, probe=True)

    def _start(self, tasks: list[Task], probe: bool = False) -> int:
        for task in tasks:
            execution = _Execution(task, probe=probe, probe_open=probe)
            self._running[task.id] = execution
            execution.runner = asyncio.create_task(self._execute(execution), name=f"rdq-task-{task.id}")
        return len(tasks)

    # ---- one attempt -----------------------------------------------------------------------------------

    async def _execute(self, execution: _Execution) -> None:
        task = execution.task
        try:
            if await self._slot(execution):
                await self._attempt(execution)
        except StoreError as e:
            # The outcome could not be written: the lease lapses and the sweep reclaims the task. Nothing lost.
            log.error("could not record the outcome: %s", e, extra={"task_id": task.id, "queue": task.queue})
        except Exception:
            log.exception("scheduler error", extra={"task_id": task.id, "queue": task.queue})
        finally:
            self._running.pop(task.id, None)
            self._end_probe(execution, None)  # handed back, abandoned, cancelled, failed to record: no verdict
            execution.done.set()
            self._free_slot(task.queue)

    async def _slot(self, execution: _Execution) -> bool:
        """Wait for a handler slot. A task claimed ahead waits at most half its lease (its lease runs meanwhile)
        and not through a stop: then it is handed back (PENDING at once, the attempt not counted)."""
        task = execution.task
        loop = asyncio.get_running_loop()
        queue = self.config.queue(task.queue)
        deadline = loop.time() + (queue.lease / 2 if queue is not None else 0.0)
        while True:
            queue = self.config.queue(task.queue)
            if queue is None:
                return True  # removed by a reload: the attempt leaves the lease to lapse
            opened = self._slot_open.setdefault(task.queue, asyncio.Event())
            held = not execution.probe and self.breakers.of(task.queue).holds()
            if not held and self.running_count(task.queue) < self._limit(queue, task.queue) and not self._stopping:
                execution.started = True
                return True
            left = deadline - loop.time()
            # Held by the breaker: handed back at once, its attempt not spent (SPEC §11).
            if self._stopping or left <= 0 or held:
                await self.store.release(task.id, task.lease_token, self.clock.now_ms())
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(opened.wait(), left)

    async def _attempt(self, execution: _Execution) -> None:
        task = execution.task
        queue = self.config.queue(task.queue)
        started = self.clock.now_ms()
        handler = self.registry.get(task.handler_ref)
        if queue is None:
            return  # queue removed by a reload: leave the lease to lapse; the task is kept
        refusal = self._refusal(task, handler, queue)
        if refusal is not None:
            report = RunReport(started, self.clock.now_ms(), Outcome.PERMANENT_FAILURE, refusal, self.instance_id)
            await self._finish_dead(task, report, refusal)
            return
        assert handler is not None
        # With the changelog (hooks.claim_logged): a task that lost a lease before has its claim in the changelog
        # before its handler runs again (_claim_logged).
        if task.lost_lease and self.hooks.claim_logged is not None and not await self._claim_logged(task, queue):
            return
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
        execution.recording = True
        self._free_slot(task.queue)
        if execution.probe:  # its verdict first: a lease lost gives none, and the slot is freed either way
            self._end_probe(execution, None if result.lease_lost else result.outcome)
        await self.record(task, queue, started, result, probe=execution.probe)

    def _end_probe(self, execution: _Execution, outcome: Outcome | None) -> None:
        """Every way a probe ends ends it once: with its outcome (success closes, a retryable failure re-opens),
        or with none (lease lost, handed back, cancelled, hand-over) — then its slot goes to the next probe."""
        if not execution.probe_open:
            return
        execution.probe_open = False
        breaker = self.breakers.of(execution.task.queue)
        if outcome is None:
            breaker.probe_void()
            self.wake(execution.task.queue)
        else:
            self.breakers.report(breaker.probe_result(outcome))

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
        recording = asyncio.ensure_future(self.record(task, queue, started, RunOutcome(Outcome.SUCCESS)))
        self._late.add(recording)
        recording.add_done_callback(self._late_recorded)

    def _late_recorded(self, recording: asyncio.Task[Result]) -> None:
        self._late.discard(recording)
        if not recording.cancelled() and recording.exception() is not None:
            log.error("could not record a late success: %s", recording.exception())

    async def record(self, task: Task, queue: QueueConfig, started: int, result: RunOutcome,
                     worker: str | None = None, probe: bool = False) -> Result:
        """Record an attempt's outcome under the task's lease token (also for remote workers' results)."""
        if not result.lease_lost and not probe:  # an abandoned attempt's outcome says nothing of the downstream
            self.breakers.record(task.queue, [result.outcome])
        now = self.clock.now_ms()
        # A probe's retryable failure is the outage's, not the task's (SPEC §11: no attempt is spent): kept in the
        # history, not counted against max_attempts (the task's next attempt has the same number).
        spared = probe and result.outcome == Outcome.RETRYABLE_FAILURE and not result.lease_lost
        note = PROBE_NOTE if spared else self._breaker_note(task, started)
        report = RunReport(started, now, result.outcome, result.error, worker or self.instance_id, note=note)
        extra = {"task_id": task.id, "queue": task.queue, "attempt": task.attempt_count}
        if result.ok:
            outcome = await self.store.record_success(task.id, task.lease_token, task.attempt_count, report)
            if outcome.accepted:
                self.telemetry.metrics.time_to_success.labels(task.queue).observe((now - task.created_at) / 1000)
            if outcome.late or not outcome.accepted:
                self.telemetry.metrics.late_successes.labels(task.queue, str(outcome.accepted).lower()).inc()
        elif result.lease_lost and result.outcome != Outcome.SUCCESS:
            return Result(False)  # abandoned after losing the lease: the task's holder now records its outcome
        else:
            counted = task.attempt_count - 1 if spared else task.attempt_count
            decision = decide(queue, result.outcome, counted, result.requested_delay, self.rand)
            if decision.retry_after is None:
                assert result.error is not None
                outcome = await self._finish_dead(task, report, result.error)
            else:
                next_at = now + int(decision.retry_after * 1000)
                outcome = await self.store.record_retry(task.id, task.lease_token, report, next_at, counted=not spared)
                if outcome.accepted and decision.retry_after == 0:
                    self.wake(task.queue)
        if not outcome.accepted:
            log.info("result refused: the task was re-queued or finished elsewhere", extra=extra)
        elif task.order_key is not None:
            self.wake(task.queue)  # its end may have released the next parked record of its key (SPEC §12)
        return outcome

    def _breaker_note(self, task: Task, started: int) -> str | None:
        """How long this task, due since `next_attempt_at`, waited for its queue's breaker before this attempt
        (SPEC §11: the history tells "failed 5 times" from "failed during the outage")."""
        due = task.next_attempt_at
        waited = self.breakers.of(task.queue).waited_ms(due, started) if due is not None else 0
        if waited < 1000:
            return None
        return f"waited {waited / 1000:.1f}s for the queue's circuit breaker (held during a downstream outage)"

    async def _finish_dead(self, task: Task, report: RunReport, reason: ErrorInfo) -> Result:
        result = await self.store.record_dead(task.id, task.lease_token, report, reason)
        if result.accepted:
            self.telemetry.metrics.dead_of(task.queue, reason.type)
            log.warning("task dead: %s: %s", reason.type, reason.message[:300],
                        extra={"task_id": task.id, "queue": task.queue})
            if self.on_dead is not None:
                self.on_dead(task)
        return result

    # ---- graceful stop (SPEC §4.9) ---------------------------------------------------------------------

    async def drain(self, grace: float) -> int:
        """Stop claiming; let running attempts finish within `grace`; release the leases still held.

        Returns how many leases were released. Releasing re-queues at once (no waiting for the lease to lapse);
        a sync handler still running in its thread is abandoned: its task runs again (at-least-once).
        """
        self._stopping = True
        pending = list(self._running.values())
        if pending:
            waits = [asyncio.ensure_future(e.done.wait()) for e in pending]
            await asyncio.wait(waits, timeout=grace)
            for w in waits:
                w.cancel()
        left = list(self._running.values())
        released = await asyncio.shield(self._release(left))
        return released

    async def hand_over(self, homes: set[tuple[str, int]], grace: float) -> int:
        """Partitions revoked (SPEC §10): their tasks are no longer claimed here (the store scopes claims to the
        active homes); running attempts of theirs finish within `grace`, the rest are released. Returns how
        many leases were released."""
        pending = [e for e in self._running.values() if e.task.home in homes]
        if pending:
            waits = [asyncio.ensure_future(e.done.wait()) for e in pending]
            await asyncio.wait(waits, timeout=grace)
            for w in waits:
                w.cancel()
        left = [e for e in self._running.values() if e.task.home in homes]
        return await asyncio.shield(self._release(left))

    async def _release(self, executions: list[_Execution]) -> int:
        released = 0
        for execution in executions:
            if execution.ctx is not None:
                execution.ctx.lose_lease()
            if execution.running is not None:
                execution.running.abandon()
            try:
                if await self.store.release(execution.task.id, execution.task.lease_token, self.clock.now_ms()):
                    released += 1
            except StoreError as e:
                log.error("could not release a lease (the sweep will reclaim it): %s", e,
                          extra={"task_id": execution.task.id})
        return released
