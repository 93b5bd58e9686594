"""The durable retry store (SPEC §3, §4): `Store` is the task operations over one SQLite database (database.py:
the file, migrations, group commit), each job in a module of its own — first delivery, claim and lease, and
outcomes here; upkeep, operator actions, ordering, the DLQ outbox, the journal and reads beside it. Every
transition after a claim is a compare-and-set on (id, lease_token, status); a refused one reports
`accepted=False` and changes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bridge.model import ErrorInfo, NewTask, Status, Task
from bridge.store.database import Database, StoreError, WriteStats, ms
from bridge.store.journal import Journal
from bridge.store.operator import OperatorActions
from bridge.store.ordering import KeyOrder
from bridge.store.outbox import DlqOutbox
from bridge.store.queries import q
from bridge.store.reads import TaskReads
from bridge.store.results import Result, RunReport, attempt_params
from bridge.store.upkeep import Upkeep

_NEVER = 2**63 - 1  # next_due_at's bound when the caller wants to know of any pending task, however far


def _insert_task(task: NewTask, conn: sqlite3.Connection) -> str:
    """One first-delivery failure (the path a batch falls back to when its bulk insert failed)."""
    conn.execute(q("insert_task"), task.params())
    if task.first_attempt is not None:
        conn.execute(q("insert_first_attempt"), task.first_attempt.params(task.id))
    return task.id


class Store(Upkeep, OperatorActions, KeyOrder, DlqOutbox, Journal, TaskReads):
    """The task operations, over one database (`db`)."""

    def __init__(self, db: Database, scoped: bool = False) -> None:
        self.db = db
        # Scoped (the changelog is on, SPEC §10): the store acts only on tasks whose home partition is in `homes`
        # (assigned to this instance and restored); the others are not this instance's to run, time out or purge.
        self.scoped = scoped

    @classmethod
    async def open(cls, path: str | Path, synchronous: str = "FULL", busy_timeout: float = 5.0,
                   group_commit_max: int = 2000, scoped: bool = False) -> Store:
        db = await Database.open(path, synchronous, busy_timeout, group_commit_max)
        try:
            # No partition is this instance's until the group assigns it and it restores.
            await db.in_thread(lambda: db.conn.execute(q("homes_clear")))
        except Exception:
            await db.close()
            raise
        return cls(db, scoped)

    @property
    def path(self) -> Path:
        return self.db.path

    @property
    def writable(self) -> bool:
        """False after a write failed for want of space or permission, until a write succeeds again (/readyz)."""
        return self.db.writable

    @property
    def stats(self) -> WriteStats:
        return self.db.stats

    async def close(self) -> None:
        await self.db.close()

    async def limit_size(self, max_bytes: int | None) -> None:
        """Cap the store file (SQLite max_page_count); past it writes fail as a full disk would. None: no cap."""
        await self.db.limit_size(max_bytes)

    async def size_bytes(self) -> int:
        return await self.db.size_bytes()

    async def schema_version(self) -> int:
        return await self.db.schema_version()

    # ---- first delivery --------------------------------------------------------------------------------

    async def submit(self, task: NewTask) -> str:
        """Store a first-delivery failure durably; returns once COMMIT returned. A record that already has a task
        in this store (same `rdq.source` and timestamp) is not stored again: the existing task stands for it."""

        return await self.db.write(functools.partial(_insert_task, task), new_task=task)

    async def submit_many(self, tasks: list[NewTask],
                          queued: Callable[[], None] | None = None) -> list[StoreError | None]:
        """Store a batch of first-delivery failures: queued together, so they share group commits (one when the
        writer is idle), without an asyncio task each. Per task: None once durable, or the StoreError it got
        (one bad row fails alone). `queued`: called once they are queued, before they commit (a write queued
        then joins their transaction, after their inserts)."""
        if not tasks:
            return []
        stored = self.db.enqueue_inserts(tasks, _insert_task)
        if queued is not None:
            queued()
        return await stored

    # ---- claim and lease -------------------------------------------------------------------------------

    async def claim_due(self, queue: str, limit: int, lease: float, owner: str, now: int) -> list[Task]:
        return await self.queue_claim(queue, limit, lease, owner, now)

    def queue_claim(self, queue: str, limit: int, lease: float, owner: str, now: int) -> Awaitable[list[Task]]:
        """`claim_due`, queued for the next group commit before this returns: behind writes queued just before
        (the tasks a first delivery is storing), in their transaction."""
        params = {"queue": queue, "limit": limit, "lease_ms": ms(lease), "owner": owner, "now": now,
                  "scoped": self.scoped}
        def claim(conn: sqlite3.Connection) -> tuple[list[Any], set[str]]:
            rows = conn.execute(q("claim_due"), params).fetchall()
            if not rows or not self.scoped:
                return rows, set()
            ids = {"ids": json.dumps([r["id"] for r in rows])}
            return rows, {r[0] for r in conn.execute(q("lost_a_lease"), ids)}

        return self._claimed(self.db.enqueue(claim))

    async def _claimed(self, claim: Awaitable[tuple[list[Any], set[str]]]) -> list[Task]:
        rows, lost = await claim
        tasks = (Task.from_row(r) for r in rows)
        tasks = (dataclasses.replace(t, lost_lease=True) if t.id in lost else t for t in tasks)
        # RETURNING order is unspecified: start the longest overdue first.
        return sorted(tasks, key=lambda t: (t.next_attempt_at or 0, t.id))

    async def next_due_at(self, queue: str, until: int = _NEVER) -> int | None:
        """When the next task `claim_due` may claim is due (None: none is pending in its scope, due by `until`)."""
        params = {"queue": queue, "scoped": self.scoped, "until": until}
        row = await self.db.read(lambda c: c.execute(q("next_due_at"), params).fetchone())
        return None if row is None else int(row[0])

    async def extend_lease(self, task_id: str, token: int, lease: float, now: int) -> bool:
        params = {"id": task_id, "token": token, "lease_ms": ms(lease), "now": now}
        return await self.db.write(lambda c: c.execute(q("extend_lease"), params).rowcount == 1)

    async def release(self, task_id: str, token: int, now: int) -> bool:
        params = {"id": task_id, "token": token, "now": now}
        return await self.db.write(lambda c: c.execute(q("release_lease"), params).rowcount == 1)

    # ---- outcomes --------------------------------------------------------------------------------------

    async def record_success(self, task_id: str, token: int, attempt_no: int, report: RunReport) -> Result:
        """Current holder: SUCCEEDED. A stale holder (its lease was reclaimed) still wins while nothing else
        finished the task: first result wins, SPEC §4.5. `attempt_no` is the attempt the handler ran as."""

        def finish(conn: sqlite3.Connection) -> Result:
            params = {"id": task_id, "token": token, "now": report.finished_at}
            got = conn.execute(q("finish_success"), params).fetchone()
            late_of = None
            if got is None:
                got = conn.execute(q("finish_late_success"), params).fetchone()
                if got is None:
                    return Result(False)
                late_of = attempt_no
            conn.execute(q("insert_attempt"), attempt_params(task_id, report, got[0], got[1], late_of))
            return Result(True, Status.SUCCEEDED, got[0], late=late_of is not None)

        return await self.db.write(finish)

    async def record_retry(self, task_id: str, token: int, report: RunReport, next_attempt_at: int,
                           counted: bool = True) -> Result:
        """PENDING again at `next_attempt_at`. `counted=False`: the attempt is kept in the history but gives its
        number back (a circuit-breaker probe's failure during an outage, SPEC §11)."""
        params = {"id": task_id, "token": token, "next_attempt_at": next_attempt_at}
        query = "reschedule" if counted else "reschedule_uncounted"
        return await self.db.write(self._transition(query, params, task_id, report, Status.PENDING))

    async def record_dead(self, task_id: str, token: int, report: RunReport, reason: ErrorInfo) -> Result:
        params = {"id": task_id, "token": token, "now": report.finished_at,
                  "reason_type": reason.type, "reason_message": reason.message}
        return await self.db.write(self._transition("finish_dead", params, task_id, report, Status.DEAD))

    @staticmethod
    def _transition(query: str, params: dict[str, Any], task_id: str, report: RunReport,
                    status: Status) -> Callable[[sqlite3.Connection], Result]:
        def apply(conn: sqlite3.Connection) -> Result:
            got = conn.execute(q(query), params).fetchone()
            if got is None:
                return Result(False)
            conn.execute(q("insert_attempt"), attempt_params(task_id, report, got[0], got[1]))
            return Result(True, status, got[0])

        return apply
