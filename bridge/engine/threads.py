"""Threads for sync handlers, accounted per queue (SPEC §8.1: sync handlers run in a thread pool).

Cancelling a future does not stop a thread: a sync handler that hangs keeps its thread for as long as it hangs.
With one shared pool, a queue whose handler hangs would take every thread and starve every other queue (their
tasks could neither run nor heartbeat, and would die LEASE_EXPIRED). So each queue has its own pool:

- `size` threads do the queue's work. A call abandoned while its thread still runs (the lease was lost, the
  handler went silent, the queue timeout ended it) is **stuck**: it no longer counts against `size`, and a
  replacement thread may start, so the queue keeps its capacity while a few calls hang.
- At most `size` stuck threads per queue are replaced. Past that the queue runs on what is left (and, when
  nothing is left, claims nothing: `free()` is 0) — one hung queue stalls itself, never the others.
- `rdq_handler_threads_stuck{queue}` shows the stuck count; a stuck call that finally returns frees its thread.
"""

from __future__ import annotations

import logging
import queue as queue_module
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)
_IDLE_EXIT = 60.0  # an idle thread ends after this long; a new one starts when work comes


class QueuePool:
    """The threads of one queue."""

    def __init__(self, name: str, size: int, on_stuck: Callable[[str, int], None] | None = None) -> None:
        self.name = name
        self.size = size
        self._on_stuck = on_stuck
        self._work: queue_module.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue_module.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # alive
        self._idle = 0  # alive and waiting for work
        self._queued = 0  # submitted, not yet picked up
        self._stuck: set[Future[Any]] = set()
        self._closed = False

    @property
    def stuck(self) -> int:
        return len(self._stuck)

    def free(self) -> int:
        """How many more calls could start at once now (working threads not busy, or threads that may start)."""
        with self._lock:
            stuck = len(self._stuck)
            capacity = self.size - max(0, stuck - self.size)  # hung calls past `size` eat into the capacity
            working = self._threads - self._idle - stuck + self._queued
            return max(0, capacity - working)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the handler threads of queue {self.name!r} are shut down")
            self._queued += 1
            self._work.put((future, fn))
            self._spawn_if_needed()
        return future

    def _spawn_if_needed(self) -> None:
        # Working threads = alive - stuck. Start one when all are busy and the queue is below its size, but never
        # past `2 * size` threads in all: hung calls beyond `size` eat into the queue's own capacity.
        working = self._threads - len(self._stuck)
        if self._queued > self._idle and working < self.size and self._threads < 2 * self.size:
            self._threads += 1
            threading.Thread(target=self._worker, name=f"rdq-handler-{self.name}", daemon=True).start()

    def _worker(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                item = self._work.get(timeout=_IDLE_EXIT)
            except queue_module.Empty:
                item = None
            with self._lock:
                self._idle -= 1
                if item is None:
                    self._threads -= 1
                    return
                self._queued -= 1
            future, fn = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # the handler's error is its outcome
                    future.set_exception(e)
            with self._lock:
                if self._closed:
                    self._threads -= 1
                    return
                self._spawn_if_needed()  # a stuck call that returned may let a waiting call start

    def abandon(self, future: Future[Any]) -> bool:
        """The caller gave up on `future`. If its thread still runs it, count it stuck until it returns.
        True when the call is stuck (so its result, if any, comes later)."""
        if future.cancel() or future.done():
            return False
        with self._lock:
            if future in self._stuck:
                return True
            self._stuck.add(future)
            self._spawn_if_needed()
            stuck = len(self._stuck)
        log.warning("a sync handler of queue %s did not stop when abandoned: %d thread(s) stuck", self.name, stuck,
                    extra={"queue": self.name})
        self._notify()
        future.add_done_callback(self._unstuck)
        return True

    def _unstuck(self, future: Future[Any]) -> None:
        with self._lock:
            self._stuck.discard(future)
        self._notify()

    def _notify(self) -> None:
        if self._on_stuck is not None:
            self._on_stuck(self.name, len(self._stuck))

    def shutdown(self) -> None:
        """Queued calls are cancelled; idle threads end; running ones end when their call returns."""
        with self._lock:
            self._closed = True
            threads = self._threads
        while True:
            try:
                item = self._work.get_nowait()
            except queue_module.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            self._work.put(None)


class HandlerThreads:
    """One QueuePool per queue, made on first use with the size `size_of(queue)` gives."""

    def __init__(self, size_of: Callable[[str], int], on_stuck: Callable[[str, int], None] | None = None) -> None:
        self._size_of = size_of
        self._on_stuck = on_stuck
        self._pools: dict[str, QueuePool] = {}
        self._lock = threading.Lock()

    def pool(self, queue: str) -> QueuePool:
        pool = self._pools.get(queue)
        if pool is None:
            with self._lock:
                pool = self._pools.get(queue)
                if pool is None:
                    pool = self._pools[queue] = QueuePool(queue, max(1, self._size_of(queue)), self._on_stuck)
        return pool

    def stuck(self) -> dict[str, int]:
        return {name: pool.stuck for name, pool in self._pools.items()}

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()
