"""A process of its own for one kind of work (SPEC §10): a core beside the bridge's, whose one GIL its threads share.

Two parts of the changelog use one: a large restore decodes its batches in it (decoder.py), and a busy writer reads
its outbox in it (outbox_read.py). Both work without it: until it is up (a spawned interpreter imports the bridge
again, ~1 s), and after it dies or fails to start, the same work runs on a thread here, as before it existed.

The process ends with the bridge: a Ctrl-C is its parent's to handle (the parent closes it), and a parent killed
with no chance to say so (SIGKILL) is noticed within half a second — no process is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class SideProcessGone(Exception):
    """The process died, could not start, or was shut down: the caller does the work on its own thread."""


class SideProcess:
    """One spawned worker process; `initializer(*initargs)` runs in it first (say, to open a connection)."""

    def __init__(self, name: str, initializer: Callable[..., None] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        self.name = name
        self._initializer = initializer
        self._initargs = initargs
        self._pool: ProcessPoolExecutor | None = None
        self._started: Future[int] | None = None

    def start(self) -> bool:
        """Start it (not waited for: see `ready`). False when it cannot start; the work stays on a thread."""
        try:
            # spawn: a fork would copy librdkafka's threads' locks mid-use, and the event loop.
            self._pool = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), _serve,
                                             (os.getpid(), self._initializer, self._initargs))
            with _main_script_left_alone():
                self._started = self._pool.submit(os.getpid)  # the process is spawned here, in this call
            return True
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("%s: no process of its own (%s); the work stays on a thread", self.name, e)
            self._pool = None
            return False

    @property
    def started(self) -> bool:
        return self._pool is not None

    @property
    def ready(self) -> bool:
        """Up and answering: until then the work runs on a thread rather than waiting for it."""
        return self.pid() is not None

    @property
    def failed(self) -> BaseException | None:
        """Why it never came up (its start, or the initializer, failed), once that is known."""
        if self._started is None or not self._started.done() or self._started.cancelled():
            return None
        return self._started.exception()

    def pid(self) -> int | None:
        """The process's, once it answered (None before, and once it failed or was closed)."""
        if self._pool is None or self._started is None or not self._started.done() or self.failed is not None \
                or self._started.cancelled():
            return None
        return self._started.result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the process. Raises SideProcessGone (and closes it) when it cannot; `fn`'s own
        exceptions come back as they are."""
        pool = self._pool
        if pool is None:
            raise SideProcessGone(f"{self.name}: not running")
        try:
            return await asyncio.wrap_future(pool.submit(fn, *args))
        except (BrokenProcessPool, OSError, RuntimeError) as e:  # died, or could not start, or shut down
            self.close()
            raise SideProcessGone(f"{self.name}: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


@contextlib.contextmanager
def _main_script_left_alone() -> Iterator[None]:
    """While a process is spawned: multiprocessing tells the child to import the parent's `__main__` again (by
    its module name or its file), which runs a script without `if __name__ == "__main__":` whole a second time —
    in a helper of the bridge's, a second bridge. What the child runs here (`_serve`, the work's functions) lives
    in bridge's modules, so the child is told of no main module: `__main__` stands in for one without a file or
    spec for the length of the start (a few ms; nothing of the bridge's reads it meanwhile)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _serve(parent: int, initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_end_with, args=(parent,), name="rdq-side-parent", daemon=True).start()
    if initializer is not None:
        initializer(*initargs)


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)
