"""Small asyncio helpers written once: a doubling backoff, a thread of its own for a blocking client, waiting
for the first of several events."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
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
    one thread each, and its callbacks run on that thread too). A daemon thread: a call that never returns
    (librdkafka has such bugs) is abandoned with its thread by the caller and cannot keep the process from
    exiting, as an executor's worker would at interpreter exit."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self._thread is None:  # started on first use, as an executor's worker is
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        self._calls.put(_Call(loop, future, lambda: fn(*args, **kwargs)))
        return await future

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            if not call.future.cancelled():  # its caller gave up before it ran: not run, as an executor skips it
                call.run()

    def shutdown(self, wait: bool = False) -> None:
        self._calls.put(None)
        if wait and self._thread is not None:
            self._thread.join()


@dataclass
class _Call:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    fn: Callable[[], Any]

    def run(self) -> None:
        try:
            result = self.fn()
        except BaseException as e:  # handed to the caller, as an executor does
            error = e  # `e` itself is unbound when the except block ends, before the loop runs the lambda
            self._settle(lambda: self.future.set_exception(error))
        else:
            self._settle(lambda: self.future.set_result(result))

    def _settle(self, settle: Callable[[], None]) -> None:
        def on_loop() -> None:
            if not self.future.done():  # cancelled meanwhile: nobody waits
                settle()

        with contextlib.suppress(RuntimeError):  # the loop closed while the call ran (an abandoned call)
            self.loop.call_soon_threadsafe(on_loop)


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
