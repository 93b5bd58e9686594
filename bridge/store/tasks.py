"""The durable retry store: SQLite on disk, WAL, `synchronous=FULL` by default (SPEC §3, §4).

Writes are group-committed: callers enqueue operations, one writer runs everything queued in a single
transaction on aiosqlite's connection thread and answers each caller only after COMMIT returned, so storing
N failures costs one fsync, not N. Every transition after a claim is a compare-and-set on
(id, lease_token, status); a refused one reports `accepted=False` and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from bridge.model import LEASE_EXPIRED, Attempt, ErrorInfo, NewTask, Outcome, Status, Task, home_params
from bridge.store.queries import migrations, q

log = logging.getLogger(__name__)
T = TypeVar("T")
_MS = 1000


class StoreError(RuntimeError):
    """The store could not be written or read (disk full, read-only, corrupt, newer schema)."""


@dataclass(frozen=True)
class Result:
    """The answer to a post-claim mutation. `accepted=False`: stale token or terminal task, nothing changed."""

    accepted: bool
    status: Status | None = None
    attempt_no: int | None = None
    late: bool = False  # a success accepted from a stale holder (first result wins, SPEC §4.5)


@dataclass(frozen=True)
class RunReport:
    """What a handler run produced, before the store numbers it."""

    started_at: int
    finished_at: int
    outcome: Outcome
    error: ErrorInfo | None = None
    worker: str | None = None
    note: str | None = None  # kept with the attempt (e.g. it waited for the queue's circuit breaker)


@dataclass(frozen=True)
class Redriven:
    """A task a redrive moved back to PENDING."""

    id: str
    queue: str
    headers: dict[str, str]


@dataclass
class _Op:
    fn: Callable[[sqlite3.Connection], Any]
    future: asyncio.Future[Any]
    new_task: NewTask | None = None  # submits are inserted in bulk with executemany


@dataclass(frozen=True)
class SweepCounts:
    lease_expired: int = 0
    timed_out: int = 0
    purged: int = 0


@dataclass
class _Stats:
    batches: int = 0
    ops: int = 0
    largest_batch: int = 0


_UNWRITABLE = {8, 10, 13, 14}  # SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN


def _unwritable(error: BaseException) -> bool:
    cause = error.__cause__ or error
    return getattr(cause, "sqlite_errorcode", 0) & 0xFF in _UNWRITABLE


def dict_rows(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    """A query's rows as dicts, for hot paths that read many columns by name: `sqlite3.Row` finds a column with a
    case-insensitive scan of every column (encoding the changelog outbox took 43 µs a task with it, 21 with
    dicts)."""
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor]


def _ms(seconds: float) -> int:
    return round(seconds * _MS)


def _attempt_params(task_id: str, report: RunReport, attempt_no: int, redrive_no: int,
                    late_result_of: int | None = None) -> dict[str, Any]:
    attempt = Attempt(attempt_no, redrive_no, report.started_at, report.finished_at, report.outcome,
                      report.error, report.worker, late_result_of, note=report.note)
    return attempt.params(task_id)


def _insert_task(task: NewTask, conn: sqlite3.Connection) -> str:
    """One first-delivery failure (the path a batch falls back to when its bulk insert failed)."""
    conn.execute(q("insert_task"), task.params())
    if task.first_attempt is not None:
        conn.execute(q("insert_first_attempt"), task.first_attempt.params(task.id))
    return task.id


class Store:
    def __init__(self, db: aiosqlite.Connection, path: Path, group_commit_max: int, scoped: bool = False) -> None:
        self._db = db
        # Scoped (the changelog is on, SPEC §10): the store acts only on tasks whose home partition is in `homes`
        # (assigned to this instance and restored); the others are not this instance's to run, time out or purge.
        self.scoped = scoped
        # Scans (stats, lists, counts for gauges and back-pressure) run on a read-only connection of their own:
        # on the writer's they would queue group commits behind a whole-table count.
        self._reader: aiosqlite.Connection | None = None
        self.path = path
        self._group_commit_max = group_commit_max
        self._queue: asyncio.Queue[_Op | None] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self.stats = _Stats()
        # False after a write failed for want of space or permission, until a write succeeds again (/readyz).
        self.writable = True

    # ---- lifecycle -------------------------------------------------------------------------------------

    @classmethod
    async def open(cls, path: str | Path, synchronous: str = "FULL", busy_timeout: float = 5.0,
                   group_commit_max: int = 2000, scoped: bool = False) -> Store:
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Payloads are the team's data: the file is created 0600, and SQLite gives its -wal and -shm files
            # the database file's permissions.
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            db = await aiosqlite.connect(str(path), isolation_level=None, timeout=busy_timeout)
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"{path}: cannot open the store: {e}") from e
        db.row_factory = sqlite3.Row
        store = cls(db, path, group_commit_max, scoped)
        try:
            await store._in_thread(store._prepare, synchronous, busy_timeout)
        except Exception as e:  # also a broken install (no migrations folder): never leave the thread running
            await db.close()
            detail = str(e) if isinstance(e, sqlite3.Error | StoreError) else f"{type(e).__name__}: {e}"
            raise StoreError(f"{path}: {detail}") from e
        try:
            store._reader = await aiosqlite.connect(f"file:{path.resolve()}?mode=ro", uri=True, timeout=busy_timeout)
            store._reader.row_factory = sqlite3.Row
        except sqlite3.Error as e:
            await db.close()
            raise StoreError(f"{path}: cannot open a reader: {e}") from e
        store._writer = asyncio.get_running_loop().create_task(store._write_loop(), name="rdq-store-writer")
        return store

    def _prepare(self, synchronous: str, busy_timeout: float) -> None:
        conn = self._conn
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise StoreError(f"cannot switch the store to WAL mode (got {mode})")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute(f"PRAGMA busy_timeout={_ms(busy_timeout)}")
        conn.execute("PRAGMA temp_store=MEMORY")
        self._migrate(conn)
        conn.execute(q("homes_clear"))  # no partition is this instance's until the group assigns and it restores

    def _migrate(self, conn: sqlite3.Connection) -> None:
        current = conn.execute("PRAGMA user_version").fetchone()[0]
        known = migrations()
        if current > len(known):
            raise StoreError(f"the store has schema version {current}, newer than this rdq-bridge knows "
                             f"({len(known)}); upgrade rdq-bridge or use another store path")
        for version, name, sql in known[current:]:
            log.info("store: applying migration %s", name)
            conn.executescript(f"BEGIN IMMEDIATE;\n{sql}\nPRAGMA user_version={version};\nCOMMIT;")

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on aiosqlite's connection thread: a whole batch costs one hop, not one per statement."""
        result: T = await self._db._execute(fn, *args)  # type: ignore[no-untyped-call]
        return result

    @property
    def _conn(self) -> sqlite3.Connection:
        return self._db._conn

    async def close(self) -> None:
        if self._writer is not None:
            await self._queue.put(None)
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None
        if self._reader is not None:
            await self._reader.close()
        await self._db.close()

    async def limit_size(self, max_bytes: int | None) -> None:
        """Cap the store file (SQLite max_page_count); past it writes fail as a full disk would. None: no cap."""
        def apply() -> None:
            page = self._conn.execute("PRAGMA page_size").fetchone()[0]
            pages = 2**31 - 2 if max_bytes is None else max(1, max_bytes // page)
            self._conn.execute(f"PRAGMA max_page_count={int(pages)}")

        await self._in_thread(apply)

    async def size_bytes(self) -> int:
        return int(await self._read(lambda c: c.execute("PRAGMA page_count").fetchone()[0]
                                    * c.execute("PRAGMA page_size").fetchone()[0]))

    async def schema_version(self) -> int:
        return int(await self._read(lambda c: c.execute("PRAGMA user_version").fetchone()[0]))

    # ---- the group-commit writer -----------------------------------------------------------------------

    async def _submit(self, fn: Callable[[sqlite3.Connection], T], new_task: NewTask | None = None) -> T:
        return await self._enqueue(fn, new_task)

    def _enqueue(self, fn: Callable[[sqlite3.Connection], T], new_task: NewTask | None = None) -> asyncio.Future[T]:
        """Queue one write for the next group commit; its future is resolved by the writer."""
        if self._writer is None or self._writer.done():
            raise StoreError("the store is closed")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Op(fn, future, new_task))
        return future

    async def _write_loop(self) -> None:
        while True:
            op = await self._queue.get()
            if op is None:
                return
            ops = [op]
            stop = False
            # Everything queued while the previous transaction committed joins this one.
            while len(ops) < self._group_commit_max and not self._queue.empty():
                more = self._queue.get_nowait()
                if more is None:
                    stop = True
                    break
                ops.append(more)
            await self._commit_batch(ops)
            if stop:
                return

    async def _commit_batch(self, ops: list[_Op]) -> None:
        try:
            outcomes = await self._in_thread(self._run_batch, ops)
        except Exception as e:  # COMMIT failed (disk full, I/O error): nothing of the batch is durable.
            self.writable = False
            error = StoreError(f"{self.path}: write failed: {e}")
            for op in ops:
                if not op.future.done():
                    op.future.set_exception(error)
            return
        self.stats.batches += 1
        self.stats.ops += len(ops)
        self.writable = not any(not ok and _unwritable(value) for ok, value in outcomes)
        self.stats.largest_batch = max(self.stats.largest_batch, len(ops))
        for op, (ok, value) in zip(ops, outcomes, strict=True):
            if op.future.done():
                continue
            if ok:
                op.future.set_result(value)
            else:
                op.future.set_exception(value)

    def _run_batch(self, ops: Sequence[_Op]) -> list[tuple[bool, Any]]:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            results = self._apply_ops(conn, ops)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return results

    def _apply_ops(self, conn: sqlite3.Connection, ops: Sequence[_Op]) -> list[tuple[bool, Any]]:
        results: list[tuple[bool, Any] | None] = [None] * len(ops)
        submits = [i for i, op in enumerate(ops) if op.new_task is not None]
        if len(submits) > 1 and self._bulk_insert(conn, [ops[i].new_task for i in submits]):  # type: ignore[misc]
            for i in submits:
                results[i] = (True, ops[i].new_task.id)  # type: ignore[union-attr]
        for i, op in enumerate(ops):
            if results[i] is not None:
                continue
            # A savepoint per operation: one failing statement does not undo the others in the batch.
            conn.execute("SAVEPOINT op")
            try:
                results[i] = (True, op.fn(conn))
                conn.execute("RELEASE op")
            except Exception as e:
                if not conn.in_transaction:
                    raise  # SQLite rolled the whole transaction back (e.g. SQLITE_FULL): the batch fails as one
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                if isinstance(e, StoreError):
                    results[i] = (False, e)
                else:
                    wrapped = StoreError(str(e))
                    wrapped.__cause__ = e
                    results[i] = (False, wrapped)
        return [r for r in results if r is not None]

    def _bulk_insert(self, conn: sqlite3.Connection, tasks: list[NewTask]) -> bool:
        conn.execute("SAVEPOINT bulk")
        try:
            conn.executemany(q("insert_task"), [t.params() for t in tasks])
            conn.executemany(q("insert_first_attempt"),
                             [t.first_attempt.params(t.id) for t in tasks if t.first_attempt is not None])
            conn.execute("RELEASE bulk")
            return True
        except Exception:  # sqlite3.Error, or e.g. OverflowError binding a value too large for an INTEGER
            if not conn.in_transaction:
                raise  # SQLite rolled the whole transaction back (e.g. SQLITE_FULL): the batch fails as one
            # A bad row (a duplicate id, a value SQLite cannot hold) fails alone on the one-by-one path.
            conn.execute("ROLLBACK TO bulk")
            conn.execute("RELEASE bulk")
            return False

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return await self._in_thread(fn, self._conn)
        except sqlite3.Error as e:
            raise StoreError(f"{self.path}: read failed: {e}") from e

    async def _scan(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """A read that may visit many rows: on the reader connection, never in the way of group commits."""
        assert self._reader is not None
        try:
            result: T = await self._reader._execute(fn, self._reader._conn)  # type: ignore[no-untyped-call]
            return result
        except sqlite3.Error as e:
            raise StoreError(f"{self.path}: read failed: {e}") from e

    # ---- first delivery --------------------------------------------------------------------------------

    async def submit(self, task: NewTask) -> str:
        """Store a first-delivery failure durably; returns once COMMIT returned. A record that already has a task
        in this store (same `rdq.source` and timestamp) is not stored again: the existing task stands for it."""

        return await self._submit(functools.partial(_insert_task, task), new_task=task)

    async def submit_many(self, tasks: list[NewTask]) -> list[StoreError | None]:
        """Store a batch of first-delivery failures: queued together, so they share group commits (one when the
        writer is idle), without an asyncio task each. Per task: None once durable, or the StoreError it got
        (one bad row fails alone)."""
        futures = [self._enqueue(functools.partial(_insert_task, task), task) for task in tasks]
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        errors: list[StoreError | None] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, StoreError):
                raise outcome
            errors.append(outcome if isinstance(outcome, StoreError) else None)
        return errors

    # ---- claim and lease -------------------------------------------------------------------------------

    async def claim_due(self, queue: str, limit: int, lease: float, owner: str, now: int) -> list[Task]:
        params = {"queue": queue, "limit": limit, "lease_ms": _ms(lease), "owner": owner, "now": now,
                  "scoped": self.scoped}
        def claim(conn: sqlite3.Connection) -> tuple[list[Any], set[str]]:
            rows = conn.execute(q("claim_due"), params).fetchall()
            if not rows or not self.scoped:
                return rows, set()
            ids = {"ids": json.dumps([r["id"] for r in rows])}
            return rows, {r[0] for r in conn.execute(q("lost_a_lease"), ids)}

        rows, lost = await self._submit(claim)
        tasks = (Task.from_row(r) for r in rows)
        tasks = (dataclasses.replace(t, lost_lease=True) if t.id in lost else t for t in tasks)
        # RETURNING order is unspecified: start the longest overdue first.
        return sorted(tasks, key=lambda t: (t.next_attempt_at or 0, t.id))

    async def next_due_at(self, queue: str) -> int | None:
        return await self._read(lambda c: c.execute(q("next_due_at"), {"queue": queue}).fetchone()[0])

    async def extend_lease(self, task_id: str, token: int, lease: float, now: int) -> bool:
        params = {"id": task_id, "token": token, "lease_ms": _ms(lease), "now": now}
        return await self._submit(lambda c: c.execute(q("extend_lease"), params).rowcount == 1)

    async def release(self, task_id: str, token: int, now: int) -> bool:
        params = {"id": task_id, "token": token, "now": now}
        return await self._submit(lambda c: c.execute(q("release_lease"), params).rowcount == 1)

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
            conn.execute(q("insert_attempt"), _attempt_params(task_id, report, got[0], got[1], late_of))
            return Result(True, Status.SUCCEEDED, got[0], late=late_of is not None)

        return await self._submit(finish)

    async def record_retry(self, task_id: str, token: int, report: RunReport, next_attempt_at: int,
                           counted: bool = True) -> Result:
        """PENDING again at `next_attempt_at`. `counted=False`: the attempt is kept in the history but gives its
        number back (a circuit-breaker probe's failure during an outage, SPEC §11)."""
        params = {"id": task_id, "token": token, "next_attempt_at": next_attempt_at}
        query = "reschedule" if counted else "reschedule_uncounted"
        return await self._submit(self._transition(query, params, task_id, report, Status.PENDING))

    async def record_dead(self, task_id: str, token: int, report: RunReport, reason: ErrorInfo) -> Result:
        params = {"id": task_id, "token": token, "now": report.finished_at,
                  "reason_type": reason.type, "reason_message": reason.message}
        return await self._submit(self._transition("finish_dead", params, task_id, report, Status.DEAD))

    @staticmethod
    def _transition(query: str, params: dict[str, Any], task_id: str, report: RunReport,
                    status: Status) -> Callable[[sqlite3.Connection], Result]:
        def apply(conn: sqlite3.Connection) -> Result:
            got = conn.execute(q(query), params).fetchone()
            if got is None:
                return Result(False)
            conn.execute(q("insert_attempt"), _attempt_params(task_id, report, got[0], got[1]))
            return Result(True, status, got[0])

        return apply

    # ---- sweep (SPEC §4.8) -----------------------------------------------------------------------------

    async def lapsed_leases(self, now: int, limit: int = 500) -> list[sqlite3.Row]:
        params = {"now": now, "limit": limit, "scoped": self.scoped}
        return await self._read(lambda c: c.execute(q("lapsed_leases"), params).fetchall())

    async def expire_lease(self, lapsed: Mapping[str, Any] | sqlite3.Row, now: int, next_attempt_at: int | None,
                           error: ErrorInfo | None = None, holder_gone: bool = False) -> bool:
        """Reclaim one lease with a LEASE_EXPIRED attempt; DEAD when `next_attempt_at` is None.

        The sweep reclaims leases that lapsed; with `holder_gone` the lease is reclaimed before it lapses
        (the remote worker holding it disconnected: the fast path)."""
        error = error or ErrorInfo(LEASE_EXPIRED, f"lease held by {lapsed['lease_owner']} lapsed without a result")
        report = RunReport(lapsed["lease_started_at"] or now, now, Outcome.LEASE_EXPIRED, error,
                           lapsed["lease_owner"])
        base = {"id": lapsed["id"], "token": lapsed["lease_token"], "now": now, "any_time": int(holder_gone)}

        def apply(conn: sqlite3.Connection) -> bool:
            if next_attempt_at is None:
                params = {**base, "reason_type": error.type,
                          "reason_message": f"{error.message}; attempts exhausted"}
                changed = conn.execute(q("expire_lease_dead"), params).rowcount
            else:
                changed = conn.execute(q("expire_lease_reschedule"),
                                       {**base, "next_attempt_at": next_attempt_at}).rowcount
            if changed != 1:
                return False
            conn.execute(q("insert_attempt"), _attempt_params(
                lapsed["id"], report, lapsed["attempt_count"], lapsed["redrive_count"]))
            return True

        return await self._submit(apply)

    async def time_out(self, queue: str, cutoff: int, now: int, message: str, limit: int = 500) -> int:
        """PENDING or IN_FLIGHT tasks whose life began before `cutoff` → DEAD rdq.Timeout."""

        def apply(conn: sqlite3.Connection) -> int:
            rows = conn.execute(q("timed_out"), {"queue": queue, "cutoff": cutoff, "limit": limit,
                                                 "scoped": self.scoped}).fetchall()
            done = 0
            for row in rows:
                params = {"id": row["id"], "status": row["status"], "token": row["lease_token"], "now": now,
                          "cutoff": cutoff, "reason_message": message}
                if conn.execute(q("time_out_task"), params).rowcount != 1:
                    continue
                done += 1
                if row["status"] == Status.IN_FLIGHT:
                    # The running attempt loses its lease to the timeout: record it so history stays whole.
                    report = RunReport(row["lease_started_at"] or now, now, Outcome.LEASE_EXPIRED,
                                       ErrorInfo("rdq.Timeout", message), row["lease_owner"])
                    conn.execute(q("insert_attempt"), _attempt_params(
                        row["id"], report, row["attempt_count"], row["redrive_count"]))
            return done

        return await self._submit(apply)

    async def purge(self, queue: str, retain_from: str, cutoff: int, limit: int = 1000) -> int:
        query = "purge_fetched" if retain_from == "fetched" else "purge_finished"

        params = {"queue": queue, "cutoff": cutoff, "limit": limit, "scoped": self.scoped}
        return await self._submit(lambda c: self._purged(c, c.execute(q(query), params).fetchall()))

    def _purged(self, conn: sqlite3.Connection, rows: list[sqlite3.Row]) -> int:
        """The rest of a purge: the deleted tasks' history, and (scoped) a tombstone for their changelog."""
        for row in rows:
            conn.execute(q("delete_attempts"), {"id": row[0]})
            conn.execute(q("delete_redrives"), {"id": row[0]})
            if self.scoped and row[1] is not None:
                conn.execute(q("tombstone_add"), {"id": row[0], "home_topic": row[1], "home_partition": row[2]})
        return len(rows)

    async def purge_task(self, task_id: str) -> bool:
        params = {"id": task_id, "scoped": self.scoped}
        return await self._submit(lambda c: self._purged(c, c.execute(q("purge_task"), params).fetchall()) == 1)

    # ---- operator actions ------------------------------------------------------------------------------

    async def redrive(self, task_id: str, now: int, by: str | None = None, request_id: str | None = None,
                      key_id: str | None = None, max_redrives: int | None = None) -> bool:
        """DEAD → PENDING due now, attempt_count 0, redrive_count + 1, history kept, audited (SPEC §7.3): who
        said they did it (`by`, self-asserted) and which verified key signed the command (`key_id`). With
        `max_redrives`, a task redriven that many times already stays DEAD (the loop guard)."""
        return bool(await self.redrive_many([task_id], now, by, request_id, key_id, max_redrives))

    async def redrive_many(self, ids: list[str], now: int, by: str | None = None, request_id: str | None = None,
                           key_id: str | None = None, max_redrives: int | None = None) -> list[Redriven]:
        """`redrive` of each task of `ids` in one transaction (one commit for a batch of a bulk redrive); returns
        those redriven, with what their redrive span needs."""

        def apply(conn: sqlite3.Connection) -> list[Redriven]:
            done = []
            for task_id in ids:
                got = conn.execute(q("redrive"), {"id": task_id, "now": now, "scoped": self.scoped,
                                                  "max_redrives": max_redrives}).fetchone()
                if got is None:
                    continue
                conn.execute(q("insert_redrive"), {"task_id": task_id, "redrive_no": got[0], "at": now, "by": by,
                                                   "request_id": request_id, "key_id": key_id})
                done.append(Redriven(task_id, got[1], json.loads(got[2])))
            return done

        return await self._submit(apply)

    async def redrive_outcomes(self, request_id: str) -> dict[str, int]:
        """Where the tasks a redrive request moved are now: succeeded, failed (DEAD again, or an attempt since the
        redrive failed), waiting (not run yet or running its first attempt), gone (purged)."""
        rows = await self._scan(lambda c: c.execute(q("redrive_outcomes"), {"request_id": request_id}).fetchall())
        out = {"succeeded": 0, "failed": 0, "waiting": 0, "gone": 0}
        for status, tried, n in rows:
            if status is None:
                out["gone"] += n
            elif status == Status.SUCCEEDED.value:
                out["succeeded"] += n
            elif status == Status.DEAD.value or tried:
                out["failed"] += n
            else:
                out["waiting"] += n
        return out

    # ---- ordering: key (SPEC §12) ----------------------------------------------------------------------

    async def skip(self, task_id: str) -> str | None:
        """A dead head holding its key (on_dead: hold) lets it go: the key's next parked task becomes due (the
        release trigger, same transaction). Returns the key, or None when the task is not such a head."""

        def apply(conn: sqlite3.Connection) -> str | None:
            row = conn.execute(q("order_skip"), {"id": task_id}).fetchone()
            return None if row is None else str(row[0])

        return await self._submit(apply)

    async def order_open_keys(self, topic: str, partition: int, queue: str) -> set[str]:
        """The keys of a partition that hold back their later records (a task running, due, parked or holding)."""
        params = {"topic": topic, "partition": partition, "queue": queue}
        rows = await self._submit(lambda c: c.execute(q("order_open_keys"), params).fetchall())
        return {r[0] for r in rows}

    async def order_open_of(self, keys: Iterable[str]) -> set[str]:
        """Which of `keys` still hold back their later records. On the writer: after every write submitted
        before it (a key must not look free while its task is on its way into the store)."""
        params = {"keys": json.dumps(list(keys))}
        rows = await self._submit(lambda c: c.execute(q("order_open_of"), params).fetchall())
        return {r[0] for r in rows}

    async def order_keys_of(self, ids: Iterable[str]) -> set[str]:
        """The ordering keys of these tasks (those of queues with ordering: key)."""
        params = {"ids": json.dumps(list(ids))}
        rows = await self._read(lambda c: c.execute(q("order_keys_of"), params).fetchall())
        return {r[0] for r in rows}

    async def order_head(self, task: Task) -> dict[str, Any] | None:
        """What a parked task waits behind: its key's earliest task not parked and not finished (or holding)."""
        if task.order_key is None:
            return None
        params = {"order_key": task.order_key, "id": task.id}
        row = await self._read(lambda c: c.execute(q("order_head"), params).fetchone())
        return None if row is None else {"id": row[0], "status": row[1]}

    async def parked_behind(self, order_key: str) -> int:
        return int(await self._read(lambda c: c.execute(q("order_parked_behind"),
                                                         {"order_key": order_key}).fetchone()[0]))

    async def parked_stats(self) -> dict[str, tuple[int, int]]:
        """Per queue: (parked tasks, the oldest one's parking time in ms)."""
        rows = await self._scan(lambda c: c.execute(q("parked_oldest")).fetchall())
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}

    async def mark_fetched(self, task_id: str, now: int) -> bool:
        params = {"id": task_id, "now": now}
        return await self._submit(lambda c: c.execute(q("mark_fetched"), params).rowcount == 1)

    # ---- DLQ outbox ------------------------------------------------------------------------------------

    async def dlq_outbox(self, limit: int = 500, now: int | None = None, skip: Iterable[str] = ()) -> list[Task]:
        """Unpublished DEAD tasks due for a (re)try at `now` (None: all of them), but those in `skip` (on their
        way already: reading them again, attempts and payload, cost the publisher most of its time)."""
        params = {"limit": limit, "now": 2**62 if now is None else now, "scoped": self.scoped,
                  "skip": json.dumps(list(skip))}

        def read(conn: sqlite3.Connection) -> list[Task]:
            rows = dict_rows(conn.execute(q("dlq_outbox"), params))
            attempts = self._attempts_of_many(conn, [r["id"] for r in rows])
            return [Task.from_row(r, attempts.get(r["id"], ()), r["parked_behind"]) for r in rows]

        # On the reader connection: on the writer's it waited behind the "published" marks of the batch before
        # (71% of the publisher's time, bench_kafka dlq). Safe: an entry leaves the publisher's pending set only
        # after its mark committed, so a later read sees it published.
        return await self._scan(read)

    async def dlq_publish_failed(self, task_id: str, error: str, next_at: int) -> bool:
        """This entry's publish failed: it waits until `next_at`; the others do not wait for it."""
        params = {"id": task_id, "error": error[:2000], "next_at": next_at}
        return await self._submit(lambda c: c.execute(q("dlq_publish_failed"), params).rowcount == 1)

    async def dlq_stuck(self) -> dict[str, dict[str, int]]:
        """By queue: how many outbox entries failed their last publish, and the most tries of one."""
        rows = await self._scan(lambda c: c.execute(q("dlq_stuck_by_queue")).fetchall())
        return {r["queue"]: {"entries": r["n"], "most_failures": r["most_failures"]} for r in rows}

    async def secret(self, name: str, make: Callable[[], bytes]) -> bytes:
        """The bridge's secret `name`, made once with `make` and kept in the store (it outlives restarts)."""
        candidate = make()

        def apply(conn: sqlite3.Connection) -> bytes:
            conn.execute(q("secret_put"), {"name": name, "value": candidate})
            return bytes(conn.execute(q("secret_get"), {"name": name}).fetchone()[0])

        return await self._submit(apply)

    async def mark_dlq_published(self, task: Task, topic: str, partition: int, offset: int, now: int,
                                 logged: bool = False) -> bool:
        """`logged`: this very state went to the changelog with the DLQ record, in one Kafka transaction."""
        params = {"id": task.id, "topic": topic, "partition": partition, "offset": offset, "now": now,
                  "redrive_count": task.redrive_count, "logged": logged}
        return await self._submit(lambda c: c.execute(q("mark_dlq_published"), params).rowcount == 1)

    # ---- admin (SPEC §7) -------------------------------------------------------------------------------

    async def admin_seen(self, request_id: str, command: str, issued_by: str | None, now: int,
                         key_id: str | None = None) -> bool:
        """Remember a verified request id (the audit of every command: what, who said, which key). False when it
        was seen before: a replay."""
        params = {"request_id": request_id, "command": command, "issued_by": issued_by, "now": now,
                  "key_id": key_id}
        return await self._submit(lambda c: c.execute(q("admin_request_seen"), params).rowcount == 1)

    async def admin_prune(self, before: int) -> None:
        await self._submit(lambda c: c.execute(q("admin_requests_prune"), {"before": before}))

    async def queue_settings(self) -> dict[str, tuple[dict[str, Any] | None, bool]]:
        rows = await self._read(lambda c: c.execute(q("queue_settings_all")).fetchall())
        return {r["queue"]: (json.loads(r["policy"]) if r["policy"] else None, bool(r["paused"])) for r in rows}

    async def set_paused(self, queue: str, paused: bool, by: str | None, now: int, key_id: str | None = None) -> None:
        params = {"queue": queue, "paused": int(paused), "by": by, "now": now, "key_id": key_id}
        await self._submit(lambda c: c.execute(q("queue_set_paused"), params))

    async def set_policy(self, queue: str, policy: dict[str, Any] | None, by: str | None, now: int,
                         key_id: str | None = None) -> None:
        params = {"queue": queue, "policy": json.dumps(policy) if policy else None, "by": by, "now": now,
                  "key_id": key_id}
        await self._submit(lambda c: c.execute(q("queue_set_policy"), params))

    async def purge_queue(self, queue: str, status: Status | None = None, before: int | None = None,
                          limit: int = 10_000) -> int:
        params = {"queue": queue, "status": status.value if status else None, "before": before, "limit": limit,
                  "scoped": self.scoped}
        return await self._submit(lambda c: self._purged(c, c.execute(q("purge_terminal"), params).fetchall()))

    async def recreate_dead(self, task: Task, topic: str, partition: int, offset: int,
                            home: tuple[str, int] | None = None) -> bool:
        """Put back a DEAD task from its DLQ envelope, same id and history. False if the store has it.
        `home`: the partition it goes home to (default: its `rdq.source` partition)."""

        def apply(conn: sqlite3.Connection) -> bool:
            if conn.execute(q("get_task"), {"id": task.id}).fetchone() is not None:
                return False
            reason = task.dead_reason
            conn.execute(q("insert_task_copy"), {
                "id": task.id, "queue": task.queue, "handler_ref": task.handler_ref,
                "handler_version": task.handler_version, "payload": task.payload,
                "payload_content_type": task.payload_content_type,
                "headers": json.dumps(task.headers, separators=(",", ":")), "attempt_count": task.attempt_count,
                "redrive_count": task.redrive_count, "created_at": task.created_at,
                "finished_at": task.finished_at or task.created_at,
                "dead_reason_type": reason.type if reason else "rdq.Unknown",
                "dead_reason_message": reason.message if reason else "", "dlq_topic": topic,
                "dlq_partition": partition, "dlq_offset": offset, **home_params(home or task.home),
                "order_key": task.order_key, "order_seq": task.order_seq,
            })  # fmt: skip
            for seq, attempt in enumerate(task.attempts, start=1):
                conn.execute(q("insert_attempt_copy"), {**attempt.params(task.id), "seq": seq})
            return True

        return await self._submit(apply)

    # ---- first-delivery journal -------------------------------------------------------------------------

    async def journal_inflight(self, run_id: str, ranges: list[tuple[str, int, int, int]],
                               committed: list[tuple[str, int, int]], now: int) -> None:
        """One transaction: this run's in-flight range per partition, and ranges now below the commit pruned."""

        def apply(conn: sqlite3.Connection) -> None:
            for topic, partition, lo, hi in ranges:
                conn.execute(q("journal_inflight"), {"topic": topic, "partition": partition, "run_id": run_id,
                                                     "lo": lo, "hi": hi, "now": now})
            for topic, partition, offset in committed:
                conn.execute(q("journal_prune"), {"topic": topic, "partition": partition, "committed": offset})

        await self._submit(apply)

    async def journal_suspects(self, run_id: str) -> list[tuple[str, int, int, int]]:
        """Ranges written by earlier runs: their records were being handled when that run ended."""
        rows = await self._read(lambda c: c.execute(q("journal_suspects"), {"run_id": run_id}).fetchall())
        return [(r[0], r[1], r[2], r[3]) for r in rows]

    async def journal_forget_partitions(self, partitions: list[tuple[str, int]]) -> None:
        def apply(conn: sqlite3.Connection) -> None:
            for topic, partition in partitions:
                conn.execute(q("journal_forget_partition"), {"topic": topic, "partition": partition})

        await self._submit(apply)

    async def journal_forget_run(self, run_id: str) -> None:
        await self._submit(lambda c: c.execute(q("journal_forget_run"), {"run_id": run_id}))

    # ---- reads -----------------------------------------------------------------------------------------

    @staticmethod
    def _attempts_of_many(conn: sqlite3.Connection, ids: list[str]) -> dict[str, tuple[Attempt, ...]]:
        """The attempts of a batch of tasks in one query (in order), not one query per task."""
        found: dict[str, list[Attempt]] = {}
        for row in dict_rows(conn.execute(q("attempts_of_many"), {"ids": json.dumps(ids)})):
            found.setdefault(row["task_id"], []).append(Attempt.from_row(row))
        return {task_id: tuple(attempts) for task_id, attempts in found.items()}

    @staticmethod
    def _attempts(conn: sqlite3.Connection, task_id: str) -> tuple[Attempt, ...]:
        return tuple(Attempt.from_row(r) for r in conn.execute(q("get_attempts"), {"id": task_id}))

    async def get(self, task_id: str) -> Task | None:
        def read(conn: sqlite3.Connection) -> Task | None:
            row = conn.execute(q("get_task"), {"id": task_id}).fetchone()
            return None if row is None else Task.from_row(row, self._attempts(conn, task_id))

        return await self._read(read)

    async def redrives(self, task_id: str) -> list[dict[str, Any]]:
        rows = await self._read(lambda c: c.execute(q("get_redrives"), {"id": task_id}).fetchall())
        return [dict(r) for r in rows]

    async def list_tasks(self, queue: str | None = None, status: Status | None = None, limit: int = 100,
                         error_type: str | None = None) -> list[Task]:
        params = {"queue": queue, "status": status.value if status else None, "limit": limit,
                  "error_type": error_type}
        rows = await self._scan(lambda c: c.execute(q("list_tasks"), params).fetchall())
        return [Task.from_row(r) for r in rows]

    async def dead_ids(self, queue: str, error_type: str | None = None, since: int | None = None,
                       until: int | None = None, limit: int = 1000) -> list[str]:
        return [task_id for task_id, _ in await self.dead_candidates(queue, error_type, since, until, limit)]

    async def dead_candidates(self, queue: str, error_type: str | None = None, since: int | None = None,
                              until: int | None = None, limit: int = 1000,
                              exclude: Iterable[str] = ()) -> list[tuple[str, int]]:
        """(id, redrive_count) of a queue's DEAD tasks matching the filters, oldest death first."""
        params = {"queue": queue, "error_type": error_type, "since": since, "until": until, "limit": limit,
                  "scoped": self.scoped, "exclude": json.dumps(list(exclude))}
        rows = await self._scan(lambda c: c.execute(q("dead_tasks_filtered"), params).fetchall())
        return [(r[0], r[1]) for r in rows]

    async def counts(self) -> dict[str, dict[str, int]]:
        rows = await self._scan(lambda c: c.execute(q("count_by_queue_status")).fetchall())
        out: dict[str, dict[str, int]] = {}
        for queue, status, n in rows:
            out.setdefault(queue, {s.value: 0 for s in Status})[status] = n
        return out

    async def open_counts(self) -> dict[str, dict[str, int]]:
        """PENDING, IN_FLIGHT and PARKED counts by queue (the open-tasks gauge)."""
        rows = await self._scan(lambda c: c.execute(q("count_open_by_queue_status")).fetchall())
        out: dict[str, dict[str, int]] = {}
        for queue, status, n in rows:
            out.setdefault(queue, {"PENDING": 0, "IN_FLIGHT": 0, "PARKED": 0})[status] = n
        return out

    async def count_open(self, queue: str) -> int:
        return int(await self._scan(lambda c: c.execute(q("count_open"), {"queue": queue}).fetchone()[0]))
