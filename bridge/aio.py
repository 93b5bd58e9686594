"""Small asyncio helpers written once: a doubling backoff, a thread of its own for a blocking client, waiting
for the first of several events."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class Backoff:
    """A delay that doubles after each failure, from `first` up to `cap`: `await backoff.sleep()` between tries."""

    def __init__(self, first: float, cap: float) -> None:
        self.first, self.cap = first, cap
        self.delay = first

    async def sleep(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.cap)

    def reset(self) -> None:
        self.delay = self.first


class OneThread:
    """A blocking client's own thread: every call to it runs there, in order (librdkafka's clients are used from
    one thread each, and its callbacks run on that thread too)."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def shutdown(self, wait: bool = False) -> None:
        self._executor.shutdown(wait=wait)


async def first_of(*events: asyncio.Event, timeout: float | None = None) -> None:  # noqa: ASYNC109 - a bound
    """Until one of `events` is set, or `timeout` seconds passed (no events: the timeout)."""
    if not events:
        await asyncio.sleep(timeout or 0.0)
        return
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
