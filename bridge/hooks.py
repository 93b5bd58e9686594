"""What one part of the bridge tells the others, wired once (dramatiq's middleware idea, without the classes).

The service builds one `Hooks` first and gives it to each part's constructor: a part calls a hook when something
happens; the parts that care subscribed to it. So no part needs a part built after it, and nothing is patched in
after construction. A hook that asks (rather than tells) has one provider.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from bridge.model import Task


class Hook:
    """Subscribers called in order, with the same arguments; one that raises stops the call (a bug, loudly)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._subscribers: list[Callable[..., Any]] = []

    def subscribe(self, fn: Callable[..., Any]) -> None:
        self._subscribers.append(fn)

    def __call__(self, *args: Any) -> None:
        for fn in self._subscribers:
            fn(*args)

    def __bool__(self) -> bool:
        return bool(self._subscribers)


class Hooks:
    def __init__(self) -> None:
        # queue: a task of it went DEAD (the DLQ publisher wakes)
        self.task_dead = Hook("a task went DEAD")
        # queue: a new PENDING task (the scheduler, or a waiting remote claim, looks now)
        self.task_pending = Hook("a new PENDING task")
        # queue, count: that many PENDING tasks due now are queued for the store's next group commit, not yet
        # committed: a claim queued now rides the same transaction (the scheduler claims them without a commit of
        # its own)
        self.due_tasks_queued = Hook("due tasks queued for the store")
        # queue, outcomes, successes: the outcomes of a batch of first attempts, and how many more succeeded (a
        # lane's chunks report successes as a count); the queue's circuit breaker counts them
        self.first_attempts = Hook("first attempts ended")
        # writable: the store can (True) or cannot (False) be written; consumption pauses while it cannot
        self.store_health = Hook("the store's health changed")
        # order keys of tasks about to be redriven: the lanes of their partitions park the keys' new records
        self.before_redrive = Hook("tasks are about to be redriven")
        # (task, timeout) → is this claim in the changelog? Asked before a task that lost a lease runs again.
        self.claim_logged: Callable[[Task, float], Awaitable[bool]] | None = None

