"""A lane's runners (lanes.py): the loops that take a partition's ready records one after another and run them.

A sync runner is one call on the queue's handler threads; an async one is one task on the loop. Each takes a
record, runs its first delivery, and hands the result back while taking the next (`report_and_next`: one lock a
record). A runner that records keep waiting on, as I/O does, is told so (`slow`) and the lane starts more.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import Protocol

from bridge.records import SourceRecord
from bridge.source.first_delivery import Begun, FirstDelivery, Ran

# A sync handler whose records take >= _SLOW seconds, _SLOW_STREAK in a row, is given more runners (it likely
# waits on I/O). One slow record is not enough: a runner that waited for the GIL sees a fast record take 5 ms,
# and more threads for a fast handler only make them fight for it.
_SLOW = 0.001
_SLOW_STREAK = 3
# No runner is added while the process computes at least this much of a core: its threads already hold the GIL
# all the time, so handlers that looked slow were waiting for it, and more threads would only lengthen the wait.
_BUSY = 0.8


class CpuLoad:
    """The process's CPU use, sampled by the consumer's watchdog (every quarter second at most)."""

    def __init__(self) -> None:
        self._since = (time.monotonic(), time.process_time())
        self.busy = False

    def sample(self, now: float) -> None:
        began, cpu_then = self._since
        if now - began >= 0.25:
            cpu = time.process_time()
            self.busy = (cpu - cpu_then) / (now - began) >= _BUSY
            self._since = (now, cpu)


class Runner:
    """One runner: the record it is running now (for the watchdog), and how to let it go."""

    __slots__ = ("abandoned", "call", "current", "park", "task")

    def __init__(self) -> None:
        self.current: Begun | None = None
        self.park = False  # the record just taken is parked, not run (its key is blocked)
        self.abandoned = False
        self.call: Future[None] | None = None  # a sync runner's call on the handler threads
        self.task: asyncio.Task[None] | None = None  # an async runner


class RunnersLane(Protocol):
    """What a runner asks of its lane."""

    delivery: FirstDelivery
    queue_name: str
    loop: asyncio.AbstractEventLoop

    def is_suspect(self, offset: int) -> bool: ...
    def runner_started(self) -> None: ...
    def next_record(self, runner: Runner) -> SourceRecord | None: ...
    def report_and_next(self, runner: Runner, ran: Ran, slow: bool) -> SourceRecord | None: ...
    def parked(self, record: SourceRecord) -> Ran: ...
    def maybe_second_runner(self) -> None: ...
    def runner_ended(self, runner: Runner) -> None: ...


def _next_to_run(lane: RunnersLane, runner: Runner, record: SourceRecord | None) -> Begun | None:
    """From `record` on, the first record whose handler is to run; those parked behind their key or becoming a
    task at once (a suspect, no handler here) are reported on the way. None: nothing more for this runner."""
    while record is not None:
        if runner.park:
            record = lane.report_and_next(runner, lane.parked(record), False)
            continue
        prepared = lane.delivery.prepare(record, lane.queue_name, lane.is_suspect(record.offset))
        if isinstance(prepared, Begun):
            return prepared
        record = lane.report_and_next(runner, Ran(record, lane.queue_name, prepared), False)
    return None


def drain_sync(lane: RunnersLane, runner: Runner) -> None:
    """A sync runner, on a handler thread: the ready records one after another."""
    lane.runner_started()
    streak = 0
    try:
        begun = _next_to_run(lane, runner, lane.next_record(runner))
        while begun is not None:
            runner.current = begun
            cpu = time.thread_time() if streak else 0.0  # a fast handler never pays for this clock
            ran = lane.delivery.run_sync(begun)
            streak = slow_streak(streak, ran.seconds, cpu) if ran.seconds >= _SLOW else 0
            begun = _next_to_run(lane, runner, lane.report_and_next(runner, ran, streak >= _SLOW_STREAK))
    finally:
        lane.runner_ended(runner)


def slow_streak(streak: int, wall: float, cpu_before: float) -> int:
    """Records in a row that took >= _SLOW mostly waiting (I/O: more runners help). The first is judged by its
    wall time alone; the next ones also by this thread's CPU time: a record that computed for 1 ms (CPU: more
    runners would only fight for the GIL) breaks the streak."""
    if wall < _SLOW:
        return 0
    if streak and time.thread_time() - cpu_before >= wall / 2:
        return 0
    return streak + 1


async def drain_async(lane: RunnersLane, runner: Runner) -> None:
    """An async runner, on the loop. Before each handler runs, a second runner is started (once) to take the next
    record should this one's handler suspend: concurrency without a task per record."""
    lane.runner_started()
    delivery = lane.delivery
    try:
        begun = _next_to_run(lane, runner, lane.next_record(runner))
        while begun is not None:
            lane.maybe_second_runner()
            runner.current = begun
            try:
                if delivery.is_async(begun.handler):
                    ran = await delivery.run_async(begun)
                else:  # no handler threads here (tests): the loop's default executor
                    ran = await lane.loop.run_in_executor(None, delivery.run_sync, begun)
            except asyncio.CancelledError:
                if runner.abandoned:
                    return  # the watchdog reported this record
                raise
            begun = _next_to_run(lane, runner, lane.report_and_next(runner, ran, False))
    finally:
        lane.runner_ended(runner)
