"""Reads of tasks and counts (for `rdq get`, lists, stats, gauges, back-pressure)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from typing import Any

from bridge.model import Attempt, Status, Task
from bridge.store.database import Database, dict_rows
from bridge.store.queries import q


def attempts_of_many(conn: sqlite3.Connection, ids: list[str]) -> dict[str, tuple[Attempt, ...]]:
    """The attempts of a batch of tasks in one query (in order), not one query per task."""
    found: dict[str, list[Attempt]] = {}
    for row in dict_rows(conn.execute(q("attempts_of_many"), {"ids": json.dumps(ids)})):
        found.setdefault(row["task_id"], []).append(Attempt.from_row(row))
    return {task_id: tuple(attempts) for task_id, attempts in found.items()}


def read_task(conn: sqlite3.Connection, task_id: str) -> Task | None:
    """A task with its whole history (the bridge's store, or `rdq store get` on a file)."""
    row = conn.execute(q("get_task"), {"id": task_id}).fetchone()
    if row is None:
        return None
    return Task.from_row(row, tuple(Attempt.from_row(r) for r in conn.execute(q("get_attempts"), {"id": task_id})))


def read_redrives(conn: sqlite3.Connection, task_id: str) -> list[dict[str, Any]]:
    return [dict(r) for r in conn.execute(q("get_redrives"), {"id": task_id})]


def read_list(conn: sqlite3.Connection, queue: str | None, status: str | None, limit: int,
              error_type: str | None = None) -> list[Task]:
    params = {"queue": queue, "status": status, "limit": limit, "error_type": error_type}
    return [Task.from_row(r) for r in conn.execute(q("list_tasks"), params).fetchall()]


def read_counts(conn: sqlite3.Connection) -> dict[str, dict[str, int]]:
    """Tasks by queue and status (every status shown, 0 included)."""
    out: dict[str, dict[str, int]] = {}
    for queue, status, n in conn.execute(q("count_by_queue_status")).fetchall():
        out.setdefault(queue, {s.value: 0 for s in Status})[status] = n
    return out


class TaskReads:
    db: Database  # the store's parts share its database and scope (Store.__init__)
    scoped: bool

    # ---- reads -----------------------------------------------------------------------------------------

    async def get(self, task_id: str) -> Task | None:
        return await self.db.read(lambda c: read_task(c, task_id))

    async def redrives(self, task_id: str) -> list[dict[str, Any]]:
        return await self.db.read(lambda c: read_redrives(c, task_id))

    async def list_tasks(self, queue: str | None = None, status: Status | None = None, limit: int = 100,
                         error_type: str | None = None) -> list[Task]:
        return await self.db.scan(lambda c: read_list(c, queue, status.value if status else None, limit, error_type))

    async def dead_ids(self, queue: str, error_type: str | None = None, since: int | None = None,
                       until: int | None = None, limit: int = 1000) -> list[str]:
        return [task_id for task_id, _ in await self.dead_candidates(queue, error_type, since, until, limit)]

    async def dead_candidates(self, queue: str, error_type: str | None = None, since: int | None = None,
                              until: int | None = None, limit: int = 1000,
                              exclude: Iterable[str] = ()) -> list[tuple[str, int]]:
        """(id, redrive_count) of a queue's DEAD tasks matching the filters, oldest death first."""
        params = {"queue": queue, "error_type": error_type, "since": since, "until": until, "limit": limit,
                  "scoped": self.scoped, "exclude": json.dumps(list(exclude))}
        rows = await self.db.scan(lambda c: c.execute(q("dead_tasks_filtered"), params).fetchall())
        return [(r[0], r[1]) for r in rows]

    async def counts(self) -> dict[str, dict[str, int]]:
        return await self.db.scan(read_counts)

    async def open_counts(self) -> dict[str, dict[str, int]]:
        """PENDING, IN_FLIGHT and PARKED counts by queue (the open-tasks gauge)."""
        rows = await self.db.scan(lambda c: c.execute(q("count_open_by_queue_status")).fetchall())
        out: dict[str, dict[str, int]] = {}
        for queue, status, n in rows:
            out.setdefault(queue, {"PENDING": 0, "IN_FLIGHT": 0, "PARKED": 0})[status] = n
        return out

    async def count_open(self, queue: str) -> int:
        return int(await self.db.scan(lambda c: c.execute(q("count_open"), {"queue": queue}).fetchone()[0]))
