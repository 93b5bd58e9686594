"""Who waits for the changelog writer (bridge/changelog/writer.py): for a task to be logged, for a number of
successful rounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from bridge.changelog.local import LocalIndex


class RoundWaiters:
    """Who waits for the writer's count of successful rounds to reach a number (a claim waits for two)."""

    def __init__(self, kick: asyncio.Event) -> None:
        self._kick = kick  # set: the writer's next round starts now, not after the commit interval
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []

    async def reach(self, target: int, rounds: int) -> None:
        if rounds >= target:
            return
        reached: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((target, reached))
        self._kick.set()
        try:
            await reached
        finally:
            self._waiting = [(t, f) for t, f in self._waiting if f is not reached]

    def ended(self, rounds: int) -> None:
        """A round succeeded: wake who waited for this count; another round at once if someone still waits."""
        for target, reached in self._waiting:
            if rounds >= target and not reached.done():
                reached.set_result(None)
        if any(not f.done() for _, f in self._waiting):
            self._kick.set()


class LoggedWaiters:
    """Who waits for a task's stored state to be in the changelog (or for the task to be gone).

    A round resolves the tasks it logged. The store is asked about the others only where it may know more than
    the rounds: a task newly waited for that a round already resolved may have logged (its read ended after the
    task's write was queued), and one held when asked (sent, its mark not committed: the mark, not a round, ends
    its wait). Every task waiting was asked about each round before, thousands behind a backlog: a tenth of the
    writer's rounds. Anything else that ends a wait outside the rounds (a task dropped with its partition, the
    first start's marks, a redelivered record's task stored before under another id) is found by a full ask after
    a round that found nothing to log (the writer idle: the ask costs no round) or every `recheck` seconds.
    """

    def __init__(self, local: LocalIndex, held: Callable[[str], bool] = lambda task_id: False,
                 recheck: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._local = local
        self._held = held  # sent, its logged mark not yet committed (bridge/changelog/holds.py)
        self._recheck = recheck
        self._clock = clock
        self._waiting: dict[str, list[Callable[[], None]]] = {}
        self._to_ask: set[str] = set()
        self._asked_all = clock()
        self._resolved_read = float("-inf")  # when the read of the last round resolved ended (`clock`)

    def add(self, task_id: str, callback: Callable[[], None], written_since: float | None = None) -> None:
        """`written_since`: the task's state was queued for the store at or after this time (`clock`); None: any
        time before now."""
        self._waiting.setdefault(task_id, []).append(callback)
        if written_since is None or written_since <= self._resolved_read:
            self._to_ask.add(task_id)  # a round resolved before this wait may have logged it

    async def resolve(self, logged: set[str], read_ended: float = float("inf"), idle: bool = False) -> None:
        """After a round: `logged` are in the changelog; some of the others are asked of the store. `read_ended`:
        when the round's outbox read had ended (`clock`): a state written later was not in it. `idle`: the read
        found nothing unlogged (every task waiting is then asked about: it costs the writer no round)."""
        self._resolved_read = max(self._resolved_read, read_ended)
        if not self._waiting:
            self._to_ask.clear()
            return
        self._call([i for i in logged if i in self._waiting])
        ask = self._to_ask & self._waiting.keys()
        if idle or self._clock() - self._asked_all >= self._recheck:
            ask, self._asked_all = set(self._waiting), self._clock()
        self._to_ask = set()  # what is added while the store answers is asked next time
        if not ask:
            return
        held = {i for i in ask if self._held(i)}  # before the read: a hold goes only once its mark committed
        still = await self._local.unlogged(ask)
        self._call([i for i in ask if i not in still])
        self._to_ask |= still & held

    async def resolve_held(self) -> None:
        """Once the marks made so far committed (`Holds.settled`): the tasks a round asked about while they were
        held are asked again now, not left for the next round. A flush (a hand-over) that left them found the
        offsets unchanged and said "committed" with their records not done: the commit stayed below them, and the
        next owner ran every record after them again (the CI scale-down run: 53 duplicate successes)."""
        await self.resolve(set(), read_ended=float("-inf"))

    def _call(self, done: list[str]) -> None:
        for task_id in done:
            for callback in self._waiting.pop(task_id, []):
                callback()
