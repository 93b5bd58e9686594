"""A large restore decodes in a process of its own (SPEC §10): a core for decoding while the store applies.

In one process the restore thread decoding the next batch and the store's thread applying this one shared one GIL:
measured, decoding took 77 µs a record there against 22-45 µs alone, and the partition waited on it (bench
`bench_changelog restore`). A small restore (a few records a partition: a rolling restart) decodes on the restore
thread: starting a process (its interpreter imports the bridge again) would cost it more than it saves.

The process decodes only; the records are read, the store written and every rule applied here. Should it die or
never start, the batch is decoded on the restore thread, and so is the rest of that restore: nothing is lost, a
restore is slower.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from bridge.changelog.picking import Picked, Record, pick_last

log = logging.getLogger(__name__)
PROCESS_FROM = 20_000  # records to restore (all partitions): from here a restore decodes in a process


class Decoder:
    """Decodes one restore's batches: in a process of its own when `start()` was called and it runs."""

    def __init__(self, in_thread: Callable[[list[Record]], Awaitable[Picked]]) -> None:
        self._in_thread = in_thread
        self._pool: ProcessPoolExecutor | None = None
        self._started: Future[int] | None = None
        self.batches_in_process = 0

    def start(self) -> None:
        try:
            # spawn: a fork would copy librdkafka's threads' locks mid-use, and the event loop.
            self._pool = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), _serve, (os.getpid(),))
            self._started = self._pool.submit(os.getpid)
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("restore: no decoding process (%s); decoding on the restore thread", e)

    async def pick(self, records: list[Record]) -> Picked:
        pool = self._pool
        if pool is None or not self._ready():
            return await self._in_thread(records)
        try:
            picked = await asyncio.wrap_future(pool.submit(pick_last, records, 0, False))
        except (BrokenProcessPool, OSError, RuntimeError) as e:  # died, or could not start, or shut down
            log.warning("restore: the decoding process failed (%s); decoding on the restore thread", e)
            self.close()
            return await self._in_thread(records)
        picked.records = records  # not sent back: the restorer has them
        self.batches_in_process += 1
        return picked

    def _ready(self) -> bool:
        """The process is up: until then (a spawned interpreter imports the bridge again: ~1 s measured) the
        batches are decoded on the restore thread, not kept waiting for it."""
        return self._started is not None and self._started.done()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _serve(parent: int) -> None:
    """The decoding process's start: a Ctrl-C is its parent's to handle (it closes this process), and it ends by
    itself when its parent is gone, killed with no chance to say so (a bridge's SIGKILL leaves no process behind)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_end_with, args=(parent,), name="rdq-decoder-parent", daemon=True).start()


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)
