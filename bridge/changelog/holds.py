"""What the changelog writer sent but the store does not show as logged yet (bridge/changelog/writer.py).

A round's "logged" marks go to the store's group commit without the writer waiting for them: that wait was a
sixth of the writer's time. Until a mark is visible to an outbox read, the records it marks are *held*: an
outbox read drops a task's state at or below the version held for it, so nothing is sent twice — above all not
a DEAD task's state from before its DLQ publish after the "published" one (the changelog's last word would
then say unpublished, and a restore elsewhere would dead-letter the task again). A hold is released at the start
of the first read after its mark committed (a read begun earlier may not see the mark), never before; and a read
filters with the holds it began with, even when another read (a flush's) released one meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from bridge.changelog.local import Entry, LocalIndex


class Holds:
    def __init__(self) -> None:
        self._held: dict[str, int] = {}  # task id → highest version sent and not yet seen marked
        self._marks: list[tuple[asyncio.Future[None], list[tuple[str, int]]]] = []

    def sent(self, entries: Iterable[Entry], mark: asyncio.Future[None]) -> None:
        """`entries` are in the changelog; `mark` commits their logged marks (the DLQ publishes' own marks follow
        in the same queue, so they are committed by the time a read after it begins)."""
        held = [(e.task_id, e.version) for e in entries]
        for task_id, version in held:
            self._held[task_id] = max(version, self._held.get(task_id, version))
        self._marks.append((mark, held))

    def before_read(self) -> None:
        """A read begins: the holds of every committed (or failed: sent again, the same state) mark go."""
        pending = []
        for mark, held in self._marks:
            if not mark.done():
                pending.append((mark, held))
                continue
            if not mark.cancelled():
                mark.exception()  # retrieved: a failed mark is logged by whoever made it
            for task_id, version in held:
                if self._held.get(task_id, version + 1) <= version:
                    del self._held[task_id]
        self._marks = pending

    async def read(self, local: LocalIndex, limit: int, skip: list[str]) -> tuple[list[Entry], bool]:
        """A round's read: up to `limit` unlogged states and tombstones, but the tasks in `skip` and what is held
        (left out before SQLite builds them: built again and dropped, the states sent whose marks were not
        committed yet were nearly half of the read's work on the failure path). True: nothing is unlogged, not
        even a state held."""
        self.before_read()
        held = dict(self._held)
        read = await local.outbox(limit, skip=skip, sent=held.items())
        read += await local.tombstones(limit)
        # Filtered with the holds as they stood when the read began, as well as now: another caller (a flush's
        # `settled`) may release a hold while this read runs, whose snapshot can predate that hold's mark.
        return self.unsent(read, held), not read and not held

    def holds(self, task_id: str) -> bool:
        """Sent, and its mark not seen committed by a read yet."""
        return task_id in self._held

    def unsent(self, entries: list[Entry], held_at_start: dict[str, int] | None = None) -> list[Entry]:
        """Of an outbox read, the states not already in the changelog. `held_at_start`: the holds when the read
        began (a hold released during the read still applies to it)."""
        before = held_at_start or {}
        if not self._held and not before:
            return entries
        return [e for e in entries if e.version > max(self._held.get(e.task_id, -1), before.get(e.task_id, -1))]

    async def settled(self) -> None:
        """Every mark made so far committed (or failed)."""
        if self._marks:
            await asyncio.wait([mark for mark, _ in self._marks])
        self.before_read()
