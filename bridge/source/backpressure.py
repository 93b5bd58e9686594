"""Back-pressure (SPEC §5.2, §5.4): when a partition is paused in librdkafka and when its lane may start records.

A partition is paused while too many of its fetched records wait for a slot, while its queue is over
`max_open_tasks`, while the store cannot be written, while it restores, and while its queue is paused by an
operator; it resumes by itself. A lane is held (its fetched records wait too, not only the fetching) for the
same reasons; records already running finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from bridge.aio import OneThread
from bridge.config import BridgeConfig
from bridge.live_config import LiveConfig
from bridge.model import Status
from bridge.source.ends import Ran
from bridge.source.lanes import Lane
from bridge.source.partitions import Partitions, PartitionState, Phase
from bridge.store.database import StoreError
from bridge.store.tasks import Store

log = logging.getLogger(__name__)
_BACKLOG_HIGH = 2000  # fetched records waiting per partition before it is paused
_BACKPRESSURE_INTERVAL = 0.25
_RESUME_FRACTION = 0.9


class Backpressure:
    def __init__(self, config: BridgeConfig, live: LiveConfig, store: Store, partitions: Partitions,
                 operator_paused: Callable[[], set[str]] | None = None) -> None:
        self.config = config
        self.live = live
        self.store = store
        self.partitions = partitions
        self._operator_paused = operator_paused or (lambda: set())
        self._backpressured: set[str] = set()  # queues at max_open_tasks
        self._open_tasks: dict[str, int] = {}
        self._was_held: set[str] = set()
        self._store_healthy = True
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def store_healthy(self) -> bool:
        return self._store_healthy

    def set_store_health(self, healthy: bool) -> None:
        if healthy != self._store_healthy:
            log.warning("store %s: consumption %s", "writable again" if healthy else "cannot be written",
                        "resumes" if healthy else "paused")
            self._store_healthy = healthy
            if healthy:
                self.start_all()

    def held_queues(self) -> set[str]:
        return self._backpressured | self._operator_paused()

    # ---- lanes ----------------------------------------------------------------------------------------------

    def start(self, state: PartitionState) -> None:
        """Let this partition's lane start what it may."""
        if state.lane is not None:
            self.hold([state])
            state.lane.dispatch()

    def start_all(self) -> None:
        for state in self.partitions:
            self.start(state)

    def hold(self, states: Iterable[PartitionState] | None = None) -> None:
        """Whether each lane may start records: not while the store cannot be written, the partition restores,
        or its queue is held (paused by an operator, at max_open_tasks)."""
        held = self.held_queues()
        for state in self.partitions if states is None else states:
            lane = state.lane
            if lane is not None and not lane.released:
                lane.held = (not self._store_healthy or state.phase is not Phase.ACTIVE or not lane.keys_loaded
                             or lane.queue_name in held)

    def counted_failure(self, lane: Lane, ran: Ran) -> None:
        """A first delivery failed into a PENDING task (not stored yet): count it open now, so a burst of failures
        is held at max_open_tasks, not a batch later. Called by the lane's runner — on a handler thread for a
        sync handler: it only counts and raises `held` flags (plain assignments); the rest runs on the loop."""
        if ran.task is None or ran.task.status != Status.PENDING:
            return
        name = lane.queue_name
        self._open_tasks[name] = open_tasks = self._open_tasks.get(name, 0) + 1
        queue = self.live.queue(name)
        if queue is not None and open_tasks >= queue.max_open_tasks:
            for other in self.partitions.lanes():
                if other.queue_name == name:
                    other.held = True
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._check, name, queue.max_open_tasks)

    def _check(self, name: str, limit: int) -> None:
        if self._open_tasks.get(name, 0) >= limit and name not in self._backpressured:
            log.warning("queue at max_open_tasks (%d): pausing its sources", limit, extra={"queue": name})
            self._backpressured.add(name)
            self.hold()

    async def watch(self, stop: asyncio.Event) -> None:
        """Each queue's open tasks, counted in the store: held at max_open_tasks, resumed below 90% of it."""
        self._loop = asyncio.get_running_loop()
        while not stop.is_set():
            for name in self.live.queue_names():
                queue = self.live.queue(name)
                if queue is None or not self._serving(name):
                    continue
                try:
                    # Up to the limit: past it the count says no more (and read a million tasks 4 times a second).
                    open_tasks = self._open_tasks[name] = await self.store.count_open(name, queue.max_open_tasks)
                except StoreError:
                    continue
                self._check(name, queue.max_open_tasks)
                if open_tasks < queue.max_open_tasks * _RESUME_FRACTION and name in self._backpressured:
                    log.info("queue drained below max_open_tasks: resuming its sources", extra={"queue": name})
                    self._backpressured.discard(name)
                    self.start_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _BACKPRESSURE_INTERVAL)

    def _serving(self, name: str) -> bool:
        """Whether a partition of this queue is consumed: the count only decides pauses of those. Skipped while
        they all restore (or none is assigned): a restore of a million tasks counted 100,000 of them four times a
        second, 7 ms each, for nothing. A queue held at its limit stays held until the next count after one
        serves."""
        return any(state.phase is Phase.ACTIVE and self.config.queue_for_topic(state.tp[0]) == name
                   for state in self.partitions)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # ---- pauses ---------------------------------------------------------------------------------------------

    def wanted_pauses(self) -> set[PartitionState]:
        """Pause a partition only when its fetched-but-waiting records pile up past a high-water mark (and until
        they drain to half of it): pausing makes librdkafka drop what it prefetched, so it is kept for real
        pressure, not for every batch that outnumbers the partition's slots."""
        states = list(self.partitions)
        if not self._store_healthy:
            return set(states)
        held = self.held_queues()
        high = _BACKLOG_HIGH
        # The fetched backlog is bounded in bytes too (1 MB records must not take gigabytes): each partition's
        # share of the bridge's budget (librdkafka's own prefetch queue has the other half, see kafka_clients).
        high_bytes = self.config.kafka.max_buffered_mb * 1024 * 1024 / 2 / max(1, len(states))
        wanted = set()
        for state in states:
            lane = state.lane
            waiting, size = (lane.backlog, lane.ready_bytes) if lane is not None else (0, 0)
            if (state.phase is Phase.RESTORING or waiting > high or size > high_bytes
                    or (state.paused and (waiting > high // 2 or size > high_bytes / 2))
                    or self.config.queue_for_topic(state.tp[0]) in held):
                wanted.add(state)
        return wanted

    async def apply(self, consumer: Consumer | None, thread: OneThread) -> None:
        """Pause and resume partitions as wanted now; lanes held or started again to match."""
        if consumer is None:
            return
        states = set(self.partitions)
        wanted = self.wanted_pauses()
        paused = {s for s in states if s.paused}
        to_pause, to_resume = wanted - paused, paused - wanted
        if to_pause:
            await thread.call(consumer.pause, _topic_partitions(to_pause))
        if to_resume:
            await thread.call(consumer.resume, _topic_partitions(to_resume))
        for state in to_pause:
            state.paused = True
        for state in to_resume:
            state.paused = False
        self.hold()
        held = self.held_queues()
        if self._was_held - held:
            self.start_all()  # a hold was lifted: records fetched meanwhile may start
        self._was_held = held

    def backlog_bytes(self) -> int:
        """Payload bytes fetched and waiting for a runner, over all partitions."""
        return sum(lane.ready_bytes for lane in self.partitions.lanes())


def _topic_partitions(states: Iterable[PartitionState]) -> list[Any]:
    return [TopicPartition(*s.tp) for s in states]
