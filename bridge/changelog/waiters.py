"""Who waits for the changelog writer (bridge/changelog/writer.py): for a task to be logged, for a number of
successful rounds."""

from __future__ import annotations

import asyncio
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
    """Who waits for a task's stored state to be in the changelog (or for the task to be gone)."""

    def __init__(self, local: LocalIndex) -> None:
        self._local = local
        self._waiting: dict[str, list[Callable[[], None]]] = {}

    def add(self, task_id: str, callback: Callable[[], None]) -> None:
        self._waiting.setdefault(task_id, []).append(callback)

    async def resolve(self, logged: set[str]) -> None:
        """After a round: `logged` are in the changelog; the others are asked of the store."""
        if not self._waiting:
            return
        done = [i for i in self._waiting if i in logged]
        rest = [i for i in self._waiting if i not in logged]
        if rest:
            still = await self._local.unlogged(rest)
            done += [i for i in rest if i not in still]
        for task_id in done:
            for callback in self._waiting.pop(task_id, []):
                callback()
