"""Reads of tasks and counts (for `rdq get`, lists, stats, gauges, back-pressure)."""

from __future__ import annotations

import base64
import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class TaskFilter:
    """Which tasks a list, an insight or the console's dead letters are about (None: any). `key`: the record key
    as text (UTF-8); `text`: a substring of the dead reason's message, any case; since/until: death time, ms."""

    queue: str | None = None
    status: str | None = None
    error_type: str | None = None
    since: int | None = None
    until: int | None = None
    key: str | None = None
    text: str | None = None
    newest: bool = False  # newest death first (else by id: creation order)

    def params(self, limit: int) -> dict[str, Any]:
        key_b64 = None if self.key is None else base64.b64encode(self.key.encode()).decode("ascii")
        return {"queue": self.queue, "status": self.status, "error_type": self.error_type, "since": self.since,
                "until": self.until, "key_b64": key_b64, "text": self.text, "newest": int(self.newest),
                "limit": limit}


def read_matching(conn: sqlite3.Connection, where: TaskFilter, limit: int) -> list[tuple[str, str | None, int | None]]:
    """(id, dead reason type, finished_at) of the tasks matching, in the filter's order."""
    return [(r[0], r[1], r[2]) for r in conn.execute(q("matching_tasks"), where.params(limit)).fetchall()]


def read_filtered(conn: sqlite3.Connection, where: TaskFilter, limit: int) -> list[Task]:
    ids = [task_id for task_id, _, _ in read_matching(conn, where, limit)]
    rows = {r["id"]: r for r in conn.execute(q("tasks_of_many"), {"ids": json.dumps(ids)}).fetchall()}
    return [Task.from_row(rows[task_id]) for task_id in ids if task_id in rows]


def read_list(conn: sqlite3.Connection, queue: str | None, status: str | None, limit: int,
              error_type: str | None = None) -> list[Task]:
    return read_filtered(conn, TaskFilter(queue, status, error_type), limit)


def read_insights(conn: sqlite3.Connection, where: TaskFilter, bucket_ms: int) -> dict[str, Any]:
    """What broke: the matching tasks grouped by error type, counted per time bucket (by death time), and their
    attempts by outcome."""
    matching = read_matching(conn, where, 1_000_000)
    by_type: dict[str, int] = {}
    over_time: dict[int, int] = {}
    for _, error_type, finished_at in matching:
        by_type[error_type or "(none)"] = by_type.get(error_type or "(none)", 0) + 1
        if finished_at is not None:
            bucket = finished_at - finished_at % bucket_ms
            over_time[bucket] = over_time.get(bucket, 0) + 1
    ids = json.dumps([task_id for task_id, _, _ in matching])
    outcomes = {r[0]: r[1] for r in conn.execute(q("outcomes_of_many"), {"ids": ids}).fetchall()}
    return {"total": len(matching), "by_error_type": dict(sorted(by_type.items(), key=lambda kv: (-kv[1], kv[0]))),
            "over_time": [[t, n] for t, n in sorted(over_time.items())], "bucket_ms": bucket_ms,
            "attempts_by_outcome": outcomes}


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

    async def filtered(self, where: TaskFilter, limit: int) -> list[Task]:
        return await self.db.scan(lambda c: read_filtered(c, where, limit))

    async def insights(self, where: TaskFilter, bucket_ms: int) -> dict[str, Any]:
        return await self.db.scan(lambda c: read_insights(c, where, bucket_ms))

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

    async def count_open(self, queue: str, most: int = -1) -> int:
        """A queue's open tasks (PENDING, IN_FLIGHT, PARKED), counted up to `most` (-1: all of them)."""
        params = {"queue": queue, "most": most}
        return int(await self.db.scan(lambda c: c.execute(q("count_open"), params).fetchone()[0]))
