"""A lane's records one at a time (lanes.py, runners.py): an async runner, a task on the loop, takes its lane's
next record, and reports each record's end while taking the next, under one lock. A planned record's success is
reported as a chunk's is (chunks.py), the pair (fetched record, seconds); every other end is a `Ran`.
ordering: key — the next record is the first whose key is not running (`Runner.park`: its key is blocked).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bridge.source.ends import Ran
from bridge.source.lane_keys import LaneKeys
from bridge.source.runners import Runner

if TYPE_CHECKING:
    from bridge.records import Fetched


class SingleRunners:
    """The one-record-at-a-time half of a Lane: its state is the lane's, guarded by the lane's lock."""

    _lock: threading.Lock
    ready: deque[Fetched]
    ready_bytes: int
    held: bool
    limit: int
    ordered: bool
    _keys: LaneKeys
    _runners: set[Runner]
    _starting: int
    _ok: list[tuple[Fetched, float]]
    _wake_pending: bool
    _on_failure: Callable[[Any, Ran], None] | None  # called with the Lane

    def _add_result(self, ran: Ran) -> tuple[bool, bool]:
        raise NotImplementedError  # Lane's

    def _after_result(self, wake: bool, spawn: int, back: bool) -> None:
        raise NotImplementedError  # Lane's

    def _start_runners(self, n: int) -> None:
        raise NotImplementedError  # Lane's

    def next_record(self, runner: Runner) -> Fetched | None:
        with self._lock:
            return self._take_next(runner)

    def _take_next(self, runner: Runner) -> Fetched | None:
        """(Under the lock.) The runner's next record; None: it is done (let go, held, nothing ready)."""
        if runner.abandoned or self.held or not self.ready:
            self._runners.discard(runner)
            return None
        if self.ordered:
            return self._next_in_order(runner)
        record = self.ready.popleft()
        self.ready_bytes -= len(record)
        return record

    def _next_in_order(self, runner: Runner) -> Fetched | None:
        """(Under the lock.) The first ready record whose key is not running (`runner.park`: its key is blocked)."""
        found = self._keys.next_ready(self.ready)
        if found is None:
            self._runners.discard(runner)
            return None
        record, runner.park = found
        self.ready_bytes -= len(record)
        return record

    def report_and_next(self, runner: Runner, ran: Ran) -> Fetched | None:
        """An async runner's record ended: report it and take the next one, under one lock. None: nothing more
        for this runner — or the watchdog abandoned the record and reported it already."""
        if ran.task is not None:
            with self._lock:
                if runner.abandoned and runner not in self._runners:
                    return None
                runner.current = None
            if self._on_failure is not None:
                self._on_failure(self, ran)  # may hold the lane (max_open_tasks) before the next record is taken
        return self._next_after(runner, ran, None)

    def report_ok_and_next(self, runner: Runner, fetched: Fetched, seconds: float) -> Fetched | None:
        """An async runner's planned record succeeded: reported as a chunk's success is, the pair (record,
        seconds), and the next record taken, under one lock (`report_and_next`'s None too)."""
        return self._next_after(runner, None, (fetched, seconds))

    def _next_after(self, runner: Runner, ran: Ran | None, ok: tuple[Fetched, float] | None) -> Fetched | None:
        """The runner's record ended as `ran`, or as the success `ok`: queued for the loop, the next one taken."""
        with self._lock:
            if runner.abandoned and runner not in self._runners:
                return None  # the watchdog ended this record (its claim) and reported it
            runner.current = None
            if ran is not None:
                wake, back = self._add_result(ran)
            else:
                assert ok is not None
                wake, back = self._add_ok(ok)
            record = self._take_next(runner)
        if wake or back:
            self._after_result(wake, 0, back)
        return record

    def maybe_second_runner(self) -> None:
        if self._starting or len(self._runners) >= self.limit or not self.ready:
            return  # read without the lock: a glance (on the loop, where runners start), checked again under it
        with self._lock:
            if not self.ready or self.held or self._starting or len(self._runners) >= self.limit:
                return
            self._starting += 1
        self._start_runners(1)

    def _add_ok(self, ok: tuple[Fetched, float]) -> tuple[bool, bool]:
        """(Under the lock.) An async runner's planned success, queued as a chunk's: (wake the loop, a key's
        record ready again)."""
        self._ok.append(ok)
        back = self.ordered and self._keys.succeeded([ok], self.ready)
        wake = not self._wake_pending
        self._wake_pending = True
        return wake, back
