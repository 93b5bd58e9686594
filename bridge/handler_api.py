"""What a handler sees and how it signals its outcome (SPEC §8.1).

A handler is `fn(ctx) -> None` (sync, run in a thread pool) or `async fn(ctx) -> None` (run on the loop).
Returning is success. Raising `Retry(after=…)` asks for a retry after a specific delay; raising `Permanent`
dead-letters the task at once. Any other exception is classified by the queue's `errors` config.
Handlers must be idempotent: delivery is at-least-once, and `ctx.task_id` is stable across retries to dedupe on.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field


class Retry(Exception):
    """Retry this task after `after` seconds (None: the queue's backoff). Not logged as an error."""

    def __init__(self, after: float | None = None, message: str = "retry requested") -> None:
        super().__init__(message)
        if after is not None and not after >= 0:  # NaN fails this test too
            raise ValueError(f"Retry(after={after!r}): a delay is a number of seconds >= 0")
        # A delay past the queue's max_retry_after (or queue_timeout) is cut to it when the retry is scheduled.
        self.after = after


class Permanent(Exception):
    """This task can never succeed: dead-letter it now."""


class LeaseLost(Exception):
    """Raised by `ctx.heartbeat()` once the lease is gone: another worker or a timeout owns the task now."""


@dataclass
class HandlerContext:
    _task_id: str | Callable[[], str] = field(repr=False)  # a ULID, or how to make it on first use
    queue: str
    attempt: int
    redrive_count: int
    payload: bytes
    content_type: str
    headers: Mapping[str, str]
    # Called by heartbeat(); the scheduler turns beats into lease extensions.
    _on_beat: Callable[[], None] | None = field(default=None, repr=False)
    # Set (from the event loop) once the lease is gone; read by heartbeat() in any thread. A plain flag:
    # one writer, and a stale read only delays the LeaseLost by one heartbeat.
    _lost: bool = field(default=False, repr=False)
    last_beat: float = field(default_factory=time.monotonic)

    @property
    def task_id(self) -> str:
        """Stable across every retry and redrive of the task: dedupe on it."""
        if callable(self._task_id):
            self._task_id = self._task_id()
        return self._task_id

    def lose_lease(self) -> None:
        self._lost = True

    @property
    def source(self) -> str:
        return self.headers.get("rdq.source", "")

    @property
    def traceparent(self) -> str | None:
        return self.headers.get("traceparent")

    def heartbeat(self) -> None:
        """Say "still working". Safe from any thread; raises LeaseLost once the task is no longer ours."""
        if self._lost:
            raise LeaseLost(f"task {self.task_id}: the lease was lost; abandon this attempt")
        self.last_beat = time.monotonic()
        if self._on_beat is not None:
            self._on_beat()

    @property
    def lease_lost(self) -> bool:
        return self._lost

    def retry_after(self, seconds: float, message: str = "retry requested") -> Retry:
        """`raise ctx.retry_after(30)`: the exception to raise for a specific delay."""
        return Retry(after=seconds, message=message)

    def permanent(self, message: str) -> Permanent:
        """`raise ctx.permanent("bad input")`: the exception to raise to dead-letter now."""
        return Permanent(message)


HandlerFn = Callable[[HandlerContext], Awaitable[None] | None]
