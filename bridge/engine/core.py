"""The retry engine, independent of Kafka: store + scheduler + sweep, and the operations others call."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from bridge.clock import Clock, SystemClock
from bridge.engine.scheduler import Scheduler
from bridge.engine.sweep import Sweeper
from bridge.engine.threads import HandlerThreads
from bridge.hooks import Hooks
from bridge.live_config import LiveConfig
from bridge.model import Task
from bridge.registry import Registry
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Engine:
    def __init__(self, store: Store, config: LiveConfig, registry: Registry, clock: Clock | None = None,
                 instance_id: str | None = None, telemetry: Telemetry | None = None,
                 hooks: Hooks | None = None) -> None:
        self.store = store
        self.config = config
        self.registry = registry
        self.clock = clock or SystemClock()
        self.instance_id = instance_id or config.current.engine.instance_id or default_instance_id()
        self.telemetry = telemetry or Telemetry()
        self.hooks = hooks or Hooks()
        # Sync handlers run on threads of their own queue: one queue's hung handler cannot starve the others.
        self.threads = HandlerThreads(self._threads_for,
                                      lambda queue, n: self.telemetry.metrics.threads_stuck.labels(queue).set(n))
        # Set whenever a task goes DEAD: the DLQ publisher wakes on it.
        self.dead_event = asyncio.Event()
        self.scheduler = Scheduler(store, registry, config, self.clock, self.instance_id, self.threads,
                                   on_dead=self._on_dead, telemetry=self.telemetry, hooks=self.hooks)
        self.sweeper = Sweeper(store, config, self.clock, on_change=self._on_change, telemetry=self.telemetry)
        # A first delivery's task: DEAD wakes the DLQ publisher (PENDING wakes the scheduler); its outcomes, the
        # queue's breaker.
        self.hooks.task_dead.subscribe(lambda queue: self.dead_event.set())
        self.hooks.first_attempts.subscribe(self.scheduler.breakers.record)

    def _threads_for(self, name: str) -> int:
        """A queue's retries (`concurrency`) plus one partition's first deliveries (`partition_concurrency`)."""
        queue = self.config.queue(name)
        return (queue.concurrency if queue else 8) + self.config.current.kafka.partition_concurrency

    def _on_dead(self, task: Task) -> None:
        self.dead_event.set()

    def _on_change(self, queue: str) -> None:
        self.scheduler.wake(queue)
        self.dead_event.set()

    async def redrive(self, task_id: str, by: str | None = None, request_id: str | None = None,
                      key_id: str | None = None, max_redrives: int | None = None) -> bool:
        """DEAD → PENDING, due now (SPEC §7.3). False when the task is missing, not DEAD, or (with
        `max_redrives`) redriven that many times already."""
        return bool(await self.redrive_many([task_id], by, request_id, key_id, max_redrives))

    async def redrive_many(self, ids: list[str], by: str | None = None, request_id: str | None = None,
                           key_id: str | None = None, max_redrives: int | None = None) -> list[str]:
        """Redrive each DEAD task of `ids` (one store transaction); returns those redriven."""
        if self.hooks.before_redrive:
            # ordering: key — before the store's transaction: once a task is PENDING, no new record of its key may
            # start inline (the lanes park them). A key blocked for a task not redriven is unblocked by a refresh.
            self.hooks.before_redrive(await self.store.order_keys_of(ids))
        done = await self.store.redrive_many(ids, self.clock.now_ms(), by, request_id, key_id, max_redrives)
        for task in done:
            self.telemetry.metrics.redrives.labels(task.queue).inc()
            self.telemetry.redrive_span(task.id, task.queue, task.headers, by)
        for queue in {task.queue for task in done}:
            self.scheduler.wake(queue)
        return [task.id for task in done]

    async def redrive_queue(self, queue: str, error_type: str | None = None, since: int | None = None,
                            until: int | None = None, limit: int = 1000, dry_run: bool = False,
                            by: str | None = None, request_id: str | None = None) -> list[str]:
        """Redrive a queue's DEAD tasks matching the filters; with dry_run, only say which."""
        ids = await self.store.dead_ids(queue, error_type, since, until, limit)
        if dry_run:
            return ids
        return await self.redrive_many(ids, by, request_id)

    def parts(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        """Scheduler (draining on stop), sweep and config watcher, as tasks to supervise."""
        return [
            asyncio.create_task(self._schedule(stop), name="rdq-scheduler"),
            asyncio.create_task(self.sweeper.run(stop, self.config.current.engine.sweep_interval), name="rdq-sweep"),
            asyncio.create_task(self.config.watch(stop), name="rdq-config-watch"),
        ]

    async def _schedule(self, stop: asyncio.Event) -> None:
        try:
            await self.scheduler.run(stop)
        finally:
            await self.scheduler.drain(self.config.current.engine.grace_period)

    async def run(self, stop: asyncio.Event) -> None:
        """The engine alone until `stop`; one part dying stops the others."""
        await supervise(self.parts(stop), stop)

    def close(self) -> None:
        self.threads.shutdown()


async def supervise(parts: list[asyncio.Task[None]], stop: asyncio.Event, within: float | None = None) -> None:
    """Wait for `stop`; if a part ends first (crash or not), set `stop` and re-raise its error. The parts then
    get `within` seconds to stop; one still running is logged with where it is stuck and cancelled (a stop
    that hangs would leave the process for a SIGKILL, and the SRE without a clue)."""
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([*parts, stopper], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    stop.set()
    failed = [p for p in done if p is not stopper and not p.cancelled() and p.exception() is not None]
    stuck = await _drain(parts, within)
    if failed:
        error = failed[0].exception()
        log.error("%s stopped with an error; stopping the bridge", failed[0].get_name())
        assert error is not None
        raise error
    if stuck:
        raise StopOverran(f"did not stop within {within:.0f} s, cancelled: {', '.join(stuck)}")


class StopOverran(RuntimeError):
    """A graceful stop that had to cancel parts of the bridge (each logged with its stack): a thread may still
    be blocked in a client call, so the process should exit without waiting for it (bridge/cli/commands.py)."""


def awaiting(task: asyncio.Task[None]) -> str:
    """The chain of coroutines a suspended task is in, one `file:line in name` each (a task's own stack shows
    only its outermost frame, not what that frame awaits)."""
    lines: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "\n".join(lines)


async def _drain(parts: list[asyncio.Task[None]], within: float | None) -> list[str]:
    if not parts:
        return []
    done, stuck = await asyncio.wait(parts, timeout=within)
    for part in done:  # retrieved, so none is reported "never retrieved"; the first failure is raised above
        _ = part.cancelled() or part.exception()
    for part in stuck:
        log.error("%s still stopping after %.0f s: cancelled; it was awaiting (outermost first):\n%s",
                  part.get_name(), within, awaiting(part))
        part.cancel()
    if stuck:  # a part that swallows its cancellation is not waited for again
        await asyncio.wait(stuck, timeout=5.0)
    return sorted(part.get_name() for part in stuck)
