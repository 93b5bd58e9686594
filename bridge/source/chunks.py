"""A lane's chunks (lanes.py, runners.py): a sync runner takes its lane's records a chunk at a time.

A chunk is taken under one lock and its successes reported under one more: a success costs its runner no lock
and no object of its own (a pair, record and seconds, in `Runner.done`). What a runner took and has not started
(`Runner.chunk`) is the lane's again whenever the runner stops short — the lane held or let go, a slow streak,
or the watchdog finding it stalled on a record — and the successes it ran before a stalled record are taken by
the watchdog, so the commit need not wait for that record to end. Each record moves between the lane and a
runner by one atomic deque operation: none is run twice or left behind.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bridge.source.ends import Ran
from bridge.source.lane_keys import LaneKeys
from bridge.source.runners import CpuLoad, Runner

if TYPE_CHECKING:
    from bridge.records import Fetched

# At most this many records a chunk. A lane's chunks start at one record and double while every record is fast; a
# slow record brings them back to one, so records wait behind a slow handler in the lane, where other runners
# take them, not in one runner's chunk.
_CHUNK = 128


class ChunkedRunners:
    """The chunk half of a Lane: its state is the lane's, guarded by the lane's lock."""

    _lock: threading.Lock
    ready: deque[Fetched]
    ready_bytes: int
    held: bool
    limit: int
    chunk_size: int
    ordered: bool
    _keys: LaneKeys
    _runners: set[Runner]
    _starting: int
    _results: list[Ran]
    _ok: list[tuple[Fetched, float]]
    _wake_pending: bool
    _load: CpuLoad
    _on_failure: Callable[[Any, Ran], None] | None  # called with the Lane
    _call_soon: Callable[..., asyncio.Handle]

    def _take_results(self) -> None:
        raise NotImplementedError  # Lane's

    def _after_result(self, wake: bool, spawn: int, back: bool) -> None:
        raise NotImplementedError  # Lane's

    def take_chunk(self, runner: Runner) -> bool:
        """Move up to `chunk_size` ready records into the runner's chunk. False: nothing more for this runner."""
        with self._lock:
            return self._take_chunk(runner)

    def _take_chunk(self, runner: Runner) -> bool:
        if runner.abandoned or self.held or not self.ready:
            self._runners.discard(runner)
            return False
        if self.ordered:
            return self._take_keyed_chunk(runner)
        ready, chunk = self.ready, runner.chunk
        taken = 0
        for _ in range(min(self.chunk_size, len(ready))):
            record = ready.popleft()
            taken += len(record)
            chunk.append(record)
        self.ready_bytes -= taken
        return True

    def _take_keyed_chunk(self, runner: Runner) -> bool:
        """(Under the lock.) ordering: key — the first ready records whose keys are not running, one a key (each
        key running from now); records of running keys wait aside. The blocked keys' records are to be parked."""
        runner.parked.clear()
        self.ready_bytes -= self._keys.take(self.ready, self.chunk_size, runner.chunk, runner.parked)
        if not runner.chunk:
            self._runners.discard(runner)
            return False
        return True

    def _give_back(self, runner: Runner) -> None:
        """(Under the lock.) The runner's records not started go back to the front of the lane, in order. One
        atomic `pop` each: a record the runner takes meanwhile is its own, the rest are the lane's."""
        chunk, ready = runner.chunk, self.ready
        while True:
            try:
                record = chunk.pop()
            except IndexError:
                return
            ready.appendleft(record)
            self.ready_bytes += len(record)
            if self.ordered:
                self._keys.handed_back(record)

    def report_one(self, runner: Runner, ran: Ran) -> None:
        """A chunk's record that ended otherwise than as a planned success (a failure, a task at once, a traced
        record): reported on its own, at once, so the consumer counts an open task and may hold the lane before
        the runner takes its next record."""
        if ran.task is not None and self._on_failure is not None:
            self._on_failure(self, ran)
        with self._lock:
            self._results.append(ran)
            back = self.ordered and self._keys.ended(ran, self.ready)
            wake = not self._wake_pending
            self._wake_pending = True
        self._after_result(wake, 0, back)

    def _take_ok(self, runner: Runner) -> bool:
        """(Under the lock.) The runner's successes not yet reported, one atomic `popleft` each (the runner may be
        adding more). True if there were any. ordering: key — their keys are free again."""
        ok, done = self._ok, runner.done
        before = len(ok)
        while True:
            try:
                ok.append(done.popleft())
            except IndexError:
                break
        if self.ordered and len(ok) > before:
            self._keys.succeeded(ok[before:], self.ready)
        return len(ok) > before

    def report_chunk(self, runner: Runner, slow: bool, fast: bool) -> bool:
        """A chunk's successes (`runner.done`), and the next chunk taken under the same lock: True if the runner
        has one. `slow`: records in a row waited (more runners may start); `fast`: every record of the chunk was
        fast (the next chunks may be larger)."""
        with self._lock:
            self._give_back(runner)  # held, let go, or slow: what it did not start is the lane's again
            wake = self._take_ok(runner) and not self._wake_pending
            self.chunk_size = min(_CHUNK, self.chunk_size * 2) if fast else 1
            if wake:
                self._wake_pending = True
            spawn = 0
            if slow and self.ready and not self.held and not self._starting and not self._load.busy:
                spawn = max(0, min(self.limit - len(self._runners), len(self.ready)))
                self._starting += spawn
            more = runner in self._runners and self._take_chunk(runner)
        if wake or spawn or (self.ordered and not more):
            self._after_result(wake, spawn, self.ordered and not more)  # a key's record may be ready again
        return more
