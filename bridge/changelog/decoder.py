"""A large restore decodes in a process of its own (SPEC §10): a core for decoding while the store applies.

In one process the restore thread decoding the next batch and the store's thread applying this one shared one GIL:
measured, decoding took 77 µs a record there against 22-45 µs alone, and the partition waited on it (bench
`bench_changelog restore`). A small restore (a few records a partition: a rolling restart) decodes on the restore
thread: starting a process (its interpreter imports the bridge again) would cost it more than it saves. And
only where a core is to spare (`core_to_spare`, service.py): under `processes: 2` on two cores the process took the
sibling's core, and a task cost more CPU there (its records pickled to it, its rows back) than on the thread.

The process decodes only (side.py); the records are read, the store written and every rule applied here. Should
it die or never start, the batch is decoded on the restore thread, and so is the rest of that restore: nothing is
lost, a restore is slower.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from bridge.changelog.picking import Picked, Record, pick_last
from bridge.changelog.side import SideProcess, SideProcessGone

log = logging.getLogger(__name__)
PROCESS_FROM = 20_000  # records to restore (all partitions): from here a restore decodes in a process


class Decoder:
    """Decodes one restore's batches: in a process of its own when `start()` was called and it runs."""

    def __init__(self, in_thread: Callable[[list[Record]], Awaitable[Picked]]) -> None:
        self._in_thread = in_thread
        self.process = SideProcess("restore decoding")
        self.batches_in_process = 0

    def start(self) -> None:
        self.process.start()

    async def pick(self, records: list[Record]) -> Picked:
        # Until the process is up the batches are decoded on the restore thread, not kept waiting for it.
        if not self.process.ready:
            return await self._in_thread(records)
        try:
            picked = await self.process.run(pick_last, records, 0, False)
        except SideProcessGone as e:
            log.warning("restore: the decoding process failed (%s); decoding on the restore thread", e)
            return await self._in_thread(records)
        picked.records = records  # not sent back: the restorer has them
        self.batches_in_process += 1
        return picked

    def close(self) -> None:
        self.process.close()
