"""Lanes: one per assigned source partition, running the first deliveries of its fetched records.

A task, a thread hop and a watchdog per record cost more than a fast handler does. A lane instead hands its
ready records to *runners*. A runner is one hop onto the queue's handler threads (sync handlers) or one task on
the loop (async handlers, remote queues) that takes records one after another off the lane's ready deque, in
offset order, until none is left.

- Concurrency within the partition (`partition_concurrency`) comes from more runners, started only when the
  handler waits (runners.py). Sync: records that took >= 1 ms several in a row, mostly not computing, start as many
  runners as there are records, up to the limit. Async: a second runner waits its turn and runs only if the
  first one's handler suspends. A fast handler is run by one runner, as a bare consumer loop runs it: more
  threads would only fight for the GIL.
- One watchdog for all lanes (the consumer calls `watch`): a record silent for a whole lease, or running past
  `queue_timeout`, is abandoned — its failure reported, its runner let go (a sync one's thread is counted stuck
  until it returns), a new runner takes the records after it.
- Results reach the loop in batches (`on_results`), so the failures of a batch are stored in one group commit.
- `ordering: key` (SPEC §12): at most one record of a key runs at a time, in offset order; a key whose record
  became a task is blocked, its later records parked (lane_keys.py).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import deque
from collections.abc import Callable

from bridge.engine.threads import HandlerThreads
from bridge.records import TP, Fetched, SourceRecord
from bridge.source.chunks import ChunkedRunners
from bridge.source.ends import Ran, Results
from bridge.source.first_delivery import FirstDelivery
from bridge.source.lane_keys import LaneKeys
from bridge.source.runners import CpuLoad, Runner, drain_async, drain_sync
from bridge.source.singles import SingleRunners

# The watchdog adds a runner when every runner is on a record this old (the first records of a lane may hang).
_STALLED = 0.1


class Lane(ChunkedRunners, SingleRunners):
    def __init__(self, tp: TP, queue_name: str, delivery: FirstDelivery, threads: HandlerThreads | None,
                 limit: int, on_results: Callable[[Lane, Results], None],
                 is_suspect: Callable[[int], bool], on_failure: Callable[[Lane, Ran], None] | None = None,
                 load: CpuLoad | None = None) -> None:
        self.tp = tp
        self.queue_name = queue_name
        self.delivery = delivery
        self.limit = max(1, limit)
        self.ready: deque[Fetched] = deque()  # as fetched: a record becomes a SourceRecord only when it must
        self.ready_bytes = 0  # payload bytes of `ready` and set aside (the consumer pauses past its share)
        # Set by the consumer (store unwritable, restoring, queue paused or at max_open_tasks): runners take no
        # more records; those running finish.
        self.held = False
        self.released = False  # let go (revoked, stopping): held for good
        self._threads = threads
        self._on_results = on_results
        self.is_suspect = is_suspect
        # Called by the runner as soon as a record failed (before its task is stored): the consumer counts the
        # open task at once and may hold the lane (max_open_tasks) before the runner takes the next record.
        self._on_failure = on_failure
        self._load = load or CpuLoad()
        self.loop = asyncio.get_running_loop()
        self._on_loop = delivery.runs_on_loop(queue_name) or threads is None
        self._call_soon = self.loop.call_soon if self._on_loop else self.loop.call_soon_threadsafe
        # Shared with the runner threads: the runners, how many are starting, the results not yet taken.
        self._lock = threading.Lock()
        self._runners: set[Runner] = set()
        self._starting = 0
        self._results: list[Ran] = []
        self._ok: list[tuple[Fetched, float]] = []  # chunks' successes (record, seconds): Results.ok
        self._wake_pending = False
        self.chunk_size = 1
        # ordering: key. Keys are the record key bytes (a lane is one partition). Under `_lock`.
        queue = delivery.config.queue(queue_name)
        self.ordered = queue is not None and queue.ordering == "key" and not queue.remote
        self._keys = LaneKeys()
        self.keys_loaded = not self.ordered  # the consumer loads the partition's open keys before its first records

    # ---- on the loop ---------------------------------------------------------------------------------------

    def add(self, records: list[Fetched]) -> None:
        size = sum([len(r) for r in records])
        with self._lock:
            self.ready.extend(records)
            self.ready_bytes += size
        self.dispatch()

    def put_back(self, records: list[SourceRecord]) -> None:
        """Records to run again (their failure could not be stored), ahead of the others."""
        fetched = [r.fetched() for r in records]
        with self._lock:
            self.ready.extendleft(reversed(fetched))
            self.ready_bytes += sum([len(r) for r in fetched])
        self.dispatch()

    def dispatch(self) -> None:
        """Start a runner if records wait and none is running (running ones take what is added)."""
        with self._lock:
            if self.held or not self.ready or self._runners or self._starting:
                return
            self._starting += 1
        self._start_runners(1)

    @property
    def set_aside(self) -> int:
        """ordering: key — records of a running key waiting aside."""
        return self._keys.set_aside

    @property
    def busy(self) -> bool:
        """Runners running or results not yet handed over."""
        return bool(self._runners or self._starting or self._results or self._ok)

    @property
    def backlog(self) -> int:
        """Fetched records not yet started: ready, and set aside behind their running key (a hot key's records
        count too, or 200k of them would grow memory without the partition ever pausing)."""
        return len(self.ready) + self.set_aside

    def running(self) -> int:
        return sum(1 for r in self._runners if r.current is not None)

    def let_go(self) -> None:
        """Revoked or stopping: nothing more starts; runners still running are left to finish (or hang)."""
        self.held = self.released = True
        with self._lock:
            self.ready.clear()
            self._keys.clear()
            self.ready_bytes = 0
            for runner in self._runners:
                runner.abandoned = True  # it reports what it is running, then takes nothing more
                runner.chunk.clear()

    def watch(self, now: float) -> None:
        """The watchdog's round: abandon overdue records; add a runner when all are busy with slow records."""
        stalled_ok = False
        with self._lock:
            overdue = []
            for runner in self._runners:
                running = runner.running()
                if running is None or runner.abandoned:
                    continue
                claim, begun = running
                why = begun.overdue(now)
                if why is not None and Runner.abandon(claim):  # else it returned just now: the runner reports it
                    runner.abandoned = True
                    overdue.append((runner, begun, why))
                if why is not None or now - begun.began >= _STALLED:
                    self._give_back(runner)  # records behind a stalled one: for another runner
                    stalled_ok = self._take_ok(runner) or stalled_ok  # and those it ran before: done
            for runner, _, _ in overdue:
                self._runners.discard(runner)
            spawn = 0
            if self._stalled(now):
                spawn = self._starting = 1
            if stalled_ok and not self._wake_pending:
                self._wake_pending = True
            else:
                stalled_ok = False
        if stalled_ok:
            self._call_soon(self._take_results)
        for runner, begun, why in overdue:
            if runner.call is not None and self._threads is not None:
                self._threads.pool(self.queue_name).abandon(runner.call)  # counted stuck until it returns
            if runner.task is not None:
                runner.task.cancel()
            self._report(self.delivery.abandoned(begun, why))
        if spawn:
            self._start_runners(spawn)

    def _stalled(self, now: float) -> bool:
        """Records wait and every runner is on an old one (or none is left): one more runner, if allowed."""
        if not self.ready or self.held or self._starting or len(self._runners) >= self.limit:
            return False
        if not self._runners:
            return True
        return not self._load.busy and all(_running_since(r) <= now - _STALLED for r in self._runners)

    def _start_runners(self, n: int) -> None:
        """Start `n` runners (already counted in `_starting`)."""
        for _ in range(n):
            runner = Runner()
            with self._lock:
                self._runners.add(runner)
            if self._on_loop:
                runner.task = self.loop.create_task(drain_async(self, runner), name=f"rdq-lane-{self.tp}")
            else:
                assert self._threads is not None
                runner.call = self._threads.pool(self.queue_name).submit(functools.partial(drain_sync, self, runner))

    def _take_results(self) -> None:
        with self._lock:
            self._wake_pending = False
            results = Results(self._results, self._ok)
            self._results, self._ok = [], []
        if results:
            self._on_results(self, results)

    # ---- asked by the runners (runners.py; a sync runner's chunks: chunks.py; an async runner's records:
    # singles.py) ---------------------------------------------------------------------------------------------

    def runner_started(self) -> None:
        with self._lock:
            self._starting -= 1

    def runner_ended(self, runner: Runner) -> None:
        with self._lock:
            self._runners.discard(runner)

    # ---- ordering: key (the state: lane_keys.py) -----------------------------------------------------------

    def load_keys(self, keys: set[bytes]) -> None:
        """The keys of this partition that have an open task in the store (at assignment): blocked from the
        start."""
        with self._lock:
            self._keys.load(keys)
            self.keys_loaded = True

    def block(self, key: bytes) -> None:
        """A task of this key is about to become due outside the lane (a redrive): its later records park behind
        it. A new generation, so a refresh that asked the store before the task was due cannot unblock it."""
        with self._lock:
            self._keys.block(key)

    def blocked_keys(self) -> dict[bytes, int]:
        """The blocked keys with nothing on its way into the store, and their generation (for `unblock`)."""
        with self._lock:
            return self._keys.blocked_keys()

    def unblock(self, free: dict[bytes, int]) -> None:
        """Keys the store found with no open task, as of `blocked_keys()` before the store was asked: unblocked if
        no task of theirs was reported since."""
        with self._lock:
            self._keys.unblock(free)

    def stored(self, keys: list[bytes | None]) -> None:
        """Tasks reported for these keys are in the store now (or were put back to run again)."""
        with self._lock:
            back = self._keys.stored(keys, self.ready)
        if back:
            self.dispatch()

    def parked(self, record: SourceRecord) -> Ran:
        queue = self.delivery.config.queue(self.queue_name)
        assert queue is not None
        return Ran(record, self.queue_name, self.delivery.parked(record, self.queue_name, queue))

    def _report(self, ran: Ran) -> None:
        """A record's end, from a runner (or the watchdog): handed to the loop in batches."""
        if ran.task is not None and self._on_failure is not None:
            self._on_failure(self, ran)
        with self._lock:
            wake, back = self._add_result(ran)
        self._after_result(wake, 0, back)

    def _add_result(self, ran: Ran) -> tuple[bool, bool]:
        """(Under the lock.) Queue a result for the loop: (wake the loop, a key's record ready again)."""
        self._results.append(ran)
        back = self.ordered and self._keys.ended(ran, self.ready)
        wake = not self._wake_pending
        self._wake_pending = True
        return wake, back

    def _after_result(self, wake: bool, spawn: int, back: bool) -> None:
        if wake:
            self._call_soon(self._take_results)
        if spawn:
            self._call_soon(self._start_runners, spawn)
        elif back:
            self._call_soon(self.dispatch)  # a waiting record is ready again (a runner may have left meanwhile)



def _running_since(runner: Runner) -> float:
    """When the runner's record began (read once: a chunk's runner ends its records without the lane's lock);
    infinity when it runs none."""
    begun = runner.current
    return float("inf") if begun is None else begun.began
