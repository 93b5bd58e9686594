"""An attempt's outcome, recorded under the task's lease token (SPEC §4.3 to §4.5): success, a retry after the
policy's delay, or DEAD; the queue's circuit breaker counts it (SPEC §11). For the scheduler's attempts and for
remote workers' results alike."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from bridge.clock import Clock
from bridge.config import QueueConfig
from bridge.engine.breaker import Breakers, State
from bridge.engine.policy import decide
from bridge.engine.runner import RunOutcome
from bridge.hooks import Hooks
from bridge.model import ErrorInfo, Outcome, Task
from bridge.store.results import Result, RunReport
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)
PROBE_NOTE = "a circuit-breaker probe during an outage: not counted against max_attempts"
HELD_NOTE = "in flight when the circuit breaker tripped, failed during the outage: not counted against max_attempts"


class Recorder:
    def __init__(self, store: Store, breakers: Breakers, clock: Clock, instance_id: str, telemetry: Telemetry,
                 hooks: Hooks, on_dead: Callable[[Task], None], rand: Callable[[], float] = random.random) -> None:
        self.store = store
        self.breakers = breakers
        self.clock = clock
        self.instance_id = instance_id
        self.telemetry = telemetry
        self.hooks = hooks  # a retry due at once, or a key's next record released: the queue looks again
        self.on_dead = on_dead
        self.rand = rand

    async def record(self, task: Task, queue: QueueConfig, started: int, result: RunOutcome,
                     worker: str | None = None, probe: bool = False) -> Result:
        """Record an attempt's outcome under the task's lease token (also for remote workers' results)."""
        held = self.breakers.of(task.queue).state != State.CLOSED  # before this outcome counts towards a trip
        if not result.lease_lost and not probe:  # an abandoned attempt's outcome says nothing of the downstream
            self.breakers.record(task.queue, [result.outcome])
        now = self.clock.now_ms()
        spared_note = self._spared_note(result, probe, held)
        spared = spared_note is not None
        note = spared_note if spared else self._breaker_note(task, started)
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
                outcome = await self.finish_dead(task, report, result.error)
            else:
                next_at = now + int(decision.retry_after * 1000)
                outcome = await self.store.record_retry(task.id, task.lease_token, report, next_at, counted=not spared)
                if outcome.accepted and decision.retry_after == 0:
                    self.hooks.task_pending(task.queue)
        if not outcome.accepted:
            log.info("result refused: the task was re-queued or finished elsewhere", extra=extra)
        elif task.order_key is not None:
            self.hooks.task_pending(task.queue)  # its end may have released the next parked record of its key
        return outcome

    @staticmethod
    def _spared_note(result: RunOutcome, probe: bool, held: bool) -> str | None:
        """The note of an attempt whose retryable failure is the outage's, not the task's (SPEC §11: no attempt is
        spent while the breaker is open): kept in the history, not counted against max_attempts (the task's next
        attempt has the same number). A probe's; or one that ended with the breaker already open or half-open —
        in flight when it tripped, it would otherwise have spent a last attempt on the outage and dead-lettered
        its task (CI: 4 of 300 with max_attempts 2). None: the attempt counts."""
        if result.outcome != Outcome.RETRYABLE_FAILURE or result.lease_lost:
            return None
        return PROBE_NOTE if probe else HELD_NOTE if held else None

    def _breaker_note(self, task: Task, started: int) -> str | None:
        """How long this task, due since `next_attempt_at`, waited for its queue's breaker before this attempt
        (SPEC §11: the history tells "failed 5 times" from "failed during the outage")."""
        due = task.next_attempt_at
        waited = self.breakers.of(task.queue).waited_ms(due, started) if due is not None else 0
        if waited < 1000:
            return None
        return f"waited {waited / 1000:.1f}s for the queue's circuit breaker (held during a downstream outage)"

    async def finish_dead(self, task: Task, report: RunReport, reason: ErrorInfo) -> Result:
        result = await self.store.record_dead(task.id, task.lease_token, report, reason)
        if result.accepted:
            self.telemetry.metrics.dead_of(task.queue, reason.type)
            log.warning("task dead: %s: %s", reason.type, reason.message[:300],
                        extra={"task_id": task.id, "queue": task.queue})
            self.on_dead(task)
        return result
