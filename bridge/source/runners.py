"""A lane's runners (lanes.py): the loops that take a partition's ready records one after another and run them.

A sync runner is one call on the queue's handler threads: it takes the lane's records a chunk at a time (one
lock a chunk, chunks.py). An async one is one task on the loop: it takes a record, runs its first delivery, and
hands the result back while taking the next (`report_and_next`; `report_ok_and_next` for a planned success: one
lock a record). A runner that records keep waiting on, as I/O does, is told so (`slow`) and the lane starts more.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import Future
from typing import Protocol, cast

from bridge.engine.runner import outcome_of_exception
from bridge.records import Fetched, SourceRecord, source_record
from bridge.source.ends import Begun, Plan, Ran
from bridge.source.first_delivery import FirstDelivery

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
    """One runner: the record it is running now (for the watchdog), the records it took and has not run yet
    (`chunk`), and how to let it go.

    The record running is held in a one-element list, `claim`: whoever pops it ends the record — the runner when
    its handler returned, or the watchdog abandoning it. `list.pop` is atomic, so a record ends exactly once
    without a lock (a chunk's records take no lock of their own)."""

    __slots__ = ("abandoned", "call", "chunk", "claim", "done", "park", "parked", "task")

    def __init__(self) -> None:
        self.claim: list[Begun] = []
        self.chunk: deque[Fetched] = deque()  # taken from the lane, not started: given back when it stalls
        # The chunk's successes (record, seconds) not reported yet: the runner's report takes them, or the
        # watchdog's when the runner stalls on a record (they are done: the commit may pass them).
        self.done: deque[tuple[Fetched, float]] = deque()
        self.park = False  # the record just taken is parked, not run (its key is blocked): an async runner's
        self.parked: set[int] = set()  # ordering: key — the chunk's records to park (offsets), not to run
        self.abandoned = False
        self.call: Future[None] | None = None  # a sync runner's call on the handler threads
        self.task: asyncio.Task[None] | None = None  # an async runner

    @property
    def current(self) -> Begun | None:
        running = self.running()
        return None if running is None else running[1]

    @current.setter
    def current(self, begun: Begun | None) -> None:
        self.claim = [] if begun is None else [begun]

    def running(self) -> tuple[list[Begun], Begun] | None:
        """The record running now and its claim, read once: the runner may end it and begin the next meanwhile (a
        new claim), so the watchdog ends the claim it read (`abandon`), never the next record's."""
        claim = self.claim
        try:
            return (claim, claim[0]) if claim else None
        except IndexError:  # ended between the two reads
            return None

    @staticmethod
    def abandon(claim: list[Begun]) -> bool:
        """The watchdog ends the record of this claim: True if the runner had not ended it first."""
        try:
            claim.pop()
            return True
        except IndexError:
            return False

    def end(self) -> bool:
        """The runner's record returned: True if it is the runner's to report (the watchdog did not abandon it)."""
        try:
            self.claim.pop()
            return True
        except IndexError:
            return False


class RunnersLane(Protocol):
    """What a runner asks of its lane."""

    delivery: FirstDelivery
    queue_name: str
    loop: asyncio.AbstractEventLoop

    def is_suspect(self, offset: int) -> bool: ...
    def runner_started(self) -> None: ...
    def next_record(self, runner: Runner) -> Fetched | None: ...
    def report_and_next(self, runner: Runner, ran: Ran) -> Fetched | None: ...
    def report_ok_and_next(self, runner: Runner, fetched: Fetched, seconds: float) -> Fetched | None: ...
    def parked(self, record: SourceRecord) -> Ran: ...
    def maybe_second_runner(self) -> None: ...
    def runner_ended(self, runner: Runner) -> None: ...

    held: bool

    def take_chunk(self, runner: Runner) -> bool: ...
    def report_one(self, runner: Runner, ran: Ran) -> None: ...
    def report_chunk(self, runner: Runner, slow: bool, fast: bool) -> bool: ...


def _next_to_run(lane: RunnersLane, runner: Runner, fetched: Fetched | None, plan: Plan | None) -> Begun | None:
    """From `fetched` on, the first record whose handler is to run; those parked behind their key or becoming a
    task at once (a suspect, no handler here) are reported on the way. None: nothing more for this runner. A
    planned record (`plan`: an async handler, tracing off) begins as fetched, no SourceRecord."""
    while fetched is not None:
        if plan is not None and not runner.park and not lane.is_suspect(fetched.offset()):
            return lane.delivery.begin(plan, fetched)
        record = source_record(fetched)
        if runner.park:
            fetched = lane.report_and_next(runner, lane.parked(record))
            continue
        prepared = lane.delivery.prepare(record, lane.queue_name, lane.is_suspect(record.offset))
        if isinstance(prepared, Begun):
            return prepared
        fetched = lane.report_and_next(runner, Ran(record, lane.queue_name, prepared))
    return None


def drain_sync(lane: RunnersLane, runner: Runner) -> None:
    """A sync runner, on a handler thread: the ready records a chunk at a time (`drain_chunks`)."""
    lane.runner_started()
    try:
        drain_chunks(lane, runner)
    finally:
        lane.runner_ended(runner)


def drain_chunks(lane: RunnersLane, runner: Runner) -> None:
    """Chunks of records, each taken and its successes reported under one lock: a success is its fetched record
    and its seconds, no lock, no SourceRecord and no `Ran` of its own. A record that does not succeed is reported
    at once; a record that waits hands the rest of the chunk back (the watchdog hands back the chunk of a runner
    stalled on a record).
    ordering: key — a chunk holds one record of a key at most (chunks.py); one whose key is blocked is parked."""
    delivery, queue_name = lane.delivery, lane.queue_name
    chunk, done, parked = runner.chunk, runner.done, runner.parked
    streak = 0
    more = lane.take_chunk(runner)
    while more:
        plan = delivery.plan(queue_name)
        fast, slow = True, False
        while not (runner.abandoned or lane.held):
            try:
                fetched = chunk.popleft()
            except IndexError:  # done, or handed back by the watchdog
                break
            offset = fetched.offset()
            if plan is None or offset in parked or lane.is_suspect(offset):
                planned, begun = None, _prepared(lane, runner, fetched)
                if begun is None:
                    continue
            else:  # the common path: the fetched record as it is
                planned, begun = plan, delivery.begin(plan, fetched)
            runner.current = begun
            cpu = time.thread_time() if streak else 0.0  # a fast handler never pays for this clock
            ran = delivery.run_sync(begun) if planned is None else _run_planned(delivery, planned, begun)
            took = begun.seconds if ran is None else ran.seconds
            if not runner.end():
                lane.report_chunk(runner, False, False)  # the watchdog reported this record
                return
            if ran is None:
                done.append((fetched, took))
            else:
                lane.report_one(runner, ran)
            if took >= _SLOW:
                fast = False
                streak = slow_streak(streak, took, cpu)
                if streak >= _SLOW_STREAK:
                    slow = True  # records in a row waited: the rest of the chunk to new runners
                    break
            else:
                streak = 0
        more = lane.report_chunk(runner, slow, fast)


def _prepared(lane: RunnersLane, runner: Runner, fetched: Fetched) -> Begun | None:
    """A chunk's record off the common path, as a SourceRecord: parked behind its key, or a task at once (a
    suspect, no handler here) — reported here, None — or its handler to run `prepare`'s way (tracing, async)."""
    record = source_record(fetched)
    if record.offset in runner.parked:
        lane.report_one(runner, lane.parked(record))
        return None
    prepared = lane.delivery.prepare(record, lane.queue_name, lane.is_suspect(record.offset))
    if not isinstance(prepared, Begun):  # a task at once: nothing runs
        lane.report_one(runner, Ran(record, lane.queue_name, prepared))
        return None
    return prepared


def _run_planned(delivery: FirstDelivery, plan: Plan, begun: Begun) -> Ran | None:
    """A planned record's handler (untraced, sync): None when it succeeded (its seconds in `begun.seconds`), the
    `Ran` of its failure otherwise."""
    try:
        plan.handler.fn(begun.ctx)
    except Exception as e:  # the handler's error is its outcome
        return delivery.ended(begun, outcome_of_exception(e, plan.queue.errors))
    begun.seconds = time.monotonic() - begun.began
    return None


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
    record should this one's handler suspend: concurrency without a task per record. A planned record's success
    is reported as its fetched record and seconds (no SourceRecord, no `Ran`), as a sync chunk's are."""
    lane.runner_started()
    delivery = lane.delivery
    plan = delivery.plan(lane.queue_name, run_async=True)
    try:
        begun = _next_to_run(lane, runner, lane.next_record(runner), plan)
        while begun is not None:
            lane.maybe_second_runner()
            runner.current = begun
            try:
                if begun.planned:  # the common path
                    ran = await _run_planned_async(delivery, begun)
                elif delivery.is_async(begun.handler):
                    ran = await delivery.run_async(begun)
                else:  # no handler threads here (tests): the loop's default executor
                    ran = await lane.loop.run_in_executor(None, delivery.run_sync, begun)
            except asyncio.CancelledError:
                if runner.abandoned:
                    return  # the watchdog reported this record
                raise
            if ran is None:
                fetched = lane.report_ok_and_next(runner, cast(Fetched, begun.record), begun.seconds)
            else:
                fetched = lane.report_and_next(runner, ran)
            begun = _next_to_run(lane, runner, fetched, plan)
    finally:
        lane.runner_ended(runner)


async def _run_planned_async(delivery: FirstDelivery, begun: Begun) -> Ran | None:
    """A planned record's async handler (untraced): None when it succeeded (its seconds in `begun.seconds`), the
    `Ran` of its failure otherwise. Cancelled (abandoned by the watchdog): raises CancelledError."""
    try:
        await begun.handler.fn(begun.ctx)  # type: ignore[misc]
    except Exception as e:  # the handler's error is its outcome
        return delivery.ended(begun, outcome_of_exception(e, begun.queue.errors))
    begun.seconds = time.monotonic() - begun.began
    return None
