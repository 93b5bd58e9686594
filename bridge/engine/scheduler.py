"""The scheduler: per-queue concurrency; claim due tasks under a lease, give each a handler slot, run it
(attempt.py), record its outcome (recorder.py). A half-open circuit breaker's probes are claimed here and end
here, whatever way their attempt ends (SPEC §11). On a stop or a hand-over, running attempts finish within the
grace period and the leases still held are released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable

from bridge.aio import first_of
from bridge.clock import Clock
from bridge.config import QueueConfig
from bridge.engine.attempt import Attempts, Execution
from bridge.engine.breaker import Breaker, Breakers, State
from bridge.engine.recorder import Recorder
from bridge.engine.release import finish_or_release
from bridge.engine.runner import RunOutcome
from bridge.engine.threads import HandlerThreads
from bridge.hooks import Hooks
from bridge.live_config import LiveConfig
from bridge.model import Outcome, Task
from bridge.registry import Registry
from bridge.store.database import StoreError
from bridge.store.results import Result
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)
_MAX_IDLE = 1.0




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
        self._running: dict[str, Execution] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._slot_freed: dict[str, asyncio.Event] = {}  # for the claim loop's idle wait
        self._slot_open: dict[str, asyncio.Event] = {}  # for tasks claimed ahead, waiting for a slot (one-shot)
        self._stopping = False
        self.hooks.task_pending.subscribe(self.wake)  # a new PENDING task, a retry due now: look again at once
        self.hooks.due_tasks_queued.subscribe(self.claim_behind)
        self._claiming: dict[str, int] = {}  # slots asked for by claims not yet answered, by queue
        self._claiming_behind: set[asyncio.Future[int]] = set()
        self.recorder = Recorder(store, self.breakers, clock, instance_id, self.telemetry, self.hooks,
                                 lambda task: self.on_dead(task) if self.on_dead is not None else None, rand)
        self.attempts = Attempts(store, registry, config, clock, instance_id, threads, self.telemetry, self.hooks,
                                 self.recorder)

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
            # Only the next idle second's tasks matter: the loop looks again by then whatever is due after it.
            now = self.clock.now_ms()
            next_due = await self.store.next_due_at(name, until=now + int(_MAX_IDLE * 1000))
            if next_due is not None:
                timeout = min(_MAX_IDLE, max(0.0, (next_due - now) / 1000))
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
        free = self._free(name, queue)
        if free <= 0:
            return 0
        return await self._queue_claim(name, queue, free)

    def claim_behind(self, name: str, due: int) -> None:
        """`due` tasks of `name`, due now, are queued for the store's next commit (a first delivery's zero-backoff
        retries): claim them behind them, in the transaction that stores them — no commit of its own, no wait for
        the queue loop. Only where run_once would claim as much (a half-open breaker's probes are the queue
        loop's). It reserves those tasks' slots, not every free one: a claim in flight that reserved them all left
        the next first delivery's retries to the queue loop. What it does not claim, it wakes the queue loop for;
        the first delivery does not (that wake's claim was a commit for nothing that held the free slots)."""
        queue = self.config.queue(name)
        free = 0
        if (queue is not None and not queue.remote and not self._stopping and not self._holding(name, queue)
                and self.breakers.of(name).state != State.HALF_OPEN):
            free = min(due, self._free(name, queue))
            if free > 0:
                self._claiming_behind.add(claim := asyncio.ensure_future(self._queue_claim(name, queue, free)))
                claim.add_done_callback(self._claimed_behind)
        if free < due:
            self.wake(name)  # the rest is the queue loop's (or a remote worker's): its claim is queued behind them

    def _claimed_behind(self, claim: asyncio.Future[int]) -> None:
        self._claiming_behind.discard(claim)
        if not claim.cancelled() and claim.exception() is not None:
            log.error("claim failed: %s", claim.exception())

    def _free(self, name: str, queue: QueueConfig) -> int:
        """How many may be claimed now: twice the slots (claimed ahead), less those running, waiting for a slot
        or being claimed."""
        free = 2 * self._limit(queue, name) - self.running_count(name) - self._waiting_count(name)
        handler = self.registry.get(queue.handler)
        if handler is not None and not handler.is_async and self.threads is not None:
            free = min(free, 2 * self.threads.pool(name).free())  # hung sync handlers hold threads: claim no more
        return free - self._claiming.get(name, 0)

    def _queue_claim(self, name: str, queue: QueueConfig, free: int) -> Awaitable[int]:
        """Queue a claim of up to `free` due tasks for the next group commit, now; its slots count as being
        claimed from now until it answers (counted when its coroutine first ran, a claim queued behind a first
        delivery's inserts was not yet counted when the queue loop looked)."""
        claim = self.store.queue_claim(name, free, queue.lease, self.instance_id, self.clock.now_ms())
        self._claiming[name] = self._claiming.get(name, 0) + free
        return self._started(name, free, claim)

    async def _started(self, name: str, free: int, claim: Awaitable[list[Task]]) -> int:
        try:
            return self._start(await claim)
        finally:
            self._claiming[name] -= free

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
            execution = Execution(task, probe=probe, probe_open=probe)
            self._running[task.id] = execution
            execution.runner = asyncio.create_task(self._execute(execution), name=f"rdq-task-{task.id}")
        return len(tasks)

    # ---- one attempt -----------------------------------------------------------------------------------

    async def _execute(self, execution: Execution) -> None:
        task = execution.task
        try:
            if await self._slot(execution):
                result = await self.attempts.run(execution)
                if result is not None:
                    await self._recorded(execution, result)
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

    async def _slot(self, execution: Execution) -> bool:
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

    async def _recorded(self, execution: Execution, result: RunOutcome) -> None:
        """The handler returned: its slot is free before its outcome is written (a retry waits for a slot, not
        for another task's fsync); a probe's verdict first (a lease lost gives none)."""
        task = execution.task
        execution.recording = True
        self._free_slot(task.queue)
        if execution.probe:
            self._end_probe(execution, None if result.lease_lost else result.outcome)
        queue = self.config.queue(task.queue)
        if queue is not None:
            await self.recorder.record(task, queue, execution.started_at, result, probe=execution.probe)

    async def record(self, task: Task, queue: QueueConfig, started: int, result: RunOutcome,
                     worker: str | None = None, probe: bool = False) -> Result:
        """Record an attempt's outcome under the task's lease token (remote workers' results come here too)."""
        return await self.recorder.record(task, queue, started, result, worker, probe)

    def _end_probe(self, execution: Execution, outcome: Outcome | None) -> None:
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

    # ---- graceful stop (SPEC §4.9) ---------------------------------------------------------------------

    async def drain(self, grace: float) -> int:
        """Stop claiming; let running attempts finish within `grace`; release the leases still held.

        Returns how many leases were released. Releasing re-queues at once (no waiting for the lease to lapse);
        a sync handler still running in its thread is abandoned: its task runs again (at-least-once).
        """
        self._stopping = True
        return await finish_or_release(lambda: list(self._running.values()), grace, self.store, self.clock)

    async def hand_over(self, homes: set[tuple[str, int]], grace: float) -> int:
        """Partitions revoked (SPEC §10): their tasks are no longer claimed here (the store scopes claims to the
        active homes); running attempts of theirs finish within `grace`, the rest are released. Returns how
        many leases were released."""
        return await finish_or_release(lambda: [e for e in self._running.values() if e.task.home in homes], grace,
                                       self.store, self.clock)
