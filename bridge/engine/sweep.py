"""The one periodic sweep across all queues (SPEC §4.8): reclaim lapsed leases, time out, purge."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable

from bridge.clock import Clock
from bridge.engine.policy import decide
from bridge.live_config import LiveConfig
from bridge.model import Outcome
from bridge.store.database import StoreError
from bridge.store.results import SweepCounts
from bridge.store.tasks import Store
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(self, store: Store, config: LiveConfig, clock: Clock,
                 on_change: Callable[[str], None] | None = None, rand: Callable[[], float] = random.random,
                 telemetry: Telemetry | None = None) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.on_change = on_change  # told which queue has new due or dead tasks
        self.rand = rand
        self.metrics = (telemetry or Telemetry()).metrics
        self._warned: set[str] = set()

    async def run(self, stop: asyncio.Event, interval: float) -> None:
        while not stop.is_set():
            try:
                await self.sweep_once()
            except StoreError as e:
                log.error("sweep failed (retrying next round): %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def sweep_once(self) -> SweepCounts:
        expired = await self.reclaim_lapsed()
        timed_out = purged = 0
        now = self.clock.now_ms()
        for name in self.config.queue_names():
            queue = self.config.queue(name)
            if queue is None:
                continue  # gone since queue_names() was read
            if queue.queue_timeout is not None:
                n = await self.store.time_out(name, now - int(queue.queue_timeout * 1000), now,
                                              f"queue_timeout of {queue.queue_timeout:g}s exceeded")
                timed_out += n
                if n:
                    self.metrics.dead_of(name, "rdq.Timeout", n)
                if n and self.on_change:
                    self.on_change(name)
            purged += await self.store.purge(name, queue.retain_from, now - int(queue.task_ttl * 1000))
        return SweepCounts(expired, timed_out, purged)

    async def reclaim_lapsed(self) -> int:
        """Each lapsed lease gets a LEASE_EXPIRED attempt that counts against max_attempts (poison pills)."""
        now = self.clock.now_ms()
        reclaimed = 0
        for row in await self.store.lapsed_leases(now):
            queue = self.config.queue(row["queue"])
            if queue is None:
                if row["queue"] not in self._warned:
                    self._warned.add(row["queue"])
                    log.warning("tasks of queue %s are not in the configuration; left untouched", row["queue"])
                continue
            decision = decide(queue, Outcome.RETRYABLE_FAILURE, row["attempt_count"], rand=self.rand)
            next_at = None if decision.retry_after is None else now + int(decision.retry_after * 1000)
            if await self.store.expire_lease(row, now, next_at):
                reclaimed += 1
                self.metrics.attempts.count(row["queue"], "LEASE_EXPIRED")
                if next_at is None:
                    self.metrics.dead_of(row["queue"], "rdq.LeaseExpired")
                if self.on_change:
                    self.on_change(row["queue"])
        return reclaimed
