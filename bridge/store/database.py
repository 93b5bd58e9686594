"""The database layer of the store: one SQLite file on disk (WAL, `synchronous=FULL` by default), its schema
migrations, and the group-commit writer (SPEC §3, §4.2).

Writes are group-committed: callers enqueue operations (`write`), one writer runs everything queued in a single
transaction on aiosqlite's connection thread and answers each caller only after COMMIT returned, so storing N
failures costs one fsync, not N; a group commit of writes that need outlive the process only (the in-flight
journal) costs none. Each operation runs under its own savepoint: one that fails does not undo the others. Reads
run on the writer's connection (`read`) or, for a scan of many rows, on a read-only connection of their own
(`scan`). What a task is and how it moves lives in tasks.py; this module knows SQL, not tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import aiosqlite

from bridge.model import NewTask
from bridge.store.bulk import insert_batch
from bridge.store.history import with_history_functions
from bridge.store.queries import migrations

log = logging.getLogger(__name__)
T = TypeVar("T")
_MS = 1000


class StoreError(RuntimeError):
    """The store could not be written or read (disk full, read-only, corrupt, newer schema)."""


def _store_error(e: Exception) -> StoreError:
    if isinstance(e, StoreError):
        return e
    wrapped = StoreError(str(e))
    wrapped.__cause__ = e
    return wrapped


def _insert_each(tasks: Sequence[NewTask], insert_one: Callable[[NewTask, sqlite3.Connection], object],
                 conn: sqlite3.Connection) -> list[StoreError | None]:
    """New tasks one by one, each under its own savepoint (the batch's bulk insert failed): a bad row fails
    alone."""
    errors: list[StoreError | None] = []
    for task in tasks:
        conn.execute("SAVEPOINT one")
        try:
            insert_one(task, conn)
            conn.execute("RELEASE one")
            errors.append(None)
        except Exception as e:
            if not conn.in_transaction:
                raise  # SQLite rolled the whole transaction back (e.g. SQLITE_FULL): the batch fails as one
            conn.execute("ROLLBACK TO one")
            conn.execute("RELEASE one")
            errors.append(_store_error(e))
    return errors


@dataclass
class _Op:
    fn: Callable[[sqlite3.Connection], Any]  # what runs when the bulk insert of the batch's new tasks failed
    future: asyncio.Future[Any]
    new_tasks: Sequence[NewTask] = ()  # submits: inserted in bulk with every other of the batch
    many: bool = False  # a batch of submits, answered with an error (or None) a task; one submit with its id
    # False: the write need survive the process, not the machine (the in-flight journal): a group commit of such
    # writes alone is not fsync'd (`Database._sync_for`).
    durable: bool = True


@dataclass
class WriteStats:
    batches: int = 0
    synced: int = 0  # of the batches, those committed with an fsync (synchronous FULL or EXTRA)
    ops: int = 0
    largest_batch: int = 0


# PRAGMA synchronous's levels used here (EXTRA is 3). NORMAL in WAL mode: a commit is written to the WAL, not fsync'd
# (the next fsync'd commit or checkpoint syncs it with what came before it): it survives the process's death, not the
# machine's.
_NORMAL, _FULL = 1, 2

_UNWRITABLE = {8, 10, 13, 14}  # SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN


def bind_without_adapting() -> None:
    """Bind None and bytes without the sqlite3 module's adaptation lookup, for every connection of the process.

    CPython's sqlite3 (3.11, 3.12) binds int, float, str and bytearray at once; any other value (None, bytes) is
    first offered to the adapter registry: a key tuple built, a failed dict lookup, two attribute probes. A task
    row is mostly NULLs and blobs, so that lookup was a large share of the store's time under the GIL (a py-spy
    profile of the restore). An adapter registered for exactly these types is one dict hit and a C call that
    hands the value back as it is: a restored task's row (14 NULLs, a blob) took 8.6 us of CPU instead of 11.8
    (`python -m bench.bench_engine binding`). Adapting to the same value changes nothing of what is stored (a test
    reads NULLs and blobs back). Registering types other than the four base ones leaves sqlite3's fast path for
    those as it is."""
    nothing: Callable[[None], None] = cast(Callable[[None], None], {}.get)  # {}.get(None) is None, a C call
    sqlite3.register_adapter(type(None), nothing)
    sqlite3.register_adapter(bytes, bytes)  # bytes(b) is b itself for an exact bytes object


bind_without_adapting()


def _unwritable(error: BaseException) -> bool:
    cause = error.__cause__ or error
    return getattr(cause, "sqlite_errorcode", 0) & 0xFF in _UNWRITABLE


def dict_rows(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    """A query's rows as dicts, for hot paths that read many columns by name: `sqlite3.Row` finds a column with a
    case-insensitive scan of every column (encoding the changelog outbox took 43 µs a task with it, 21 with
    dicts)."""
    return list(iter_dict_rows(cursor))


def iter_dict_rows(cursor: sqlite3.Cursor) -> Iterator[dict[str, Any]]:
    """`dict_rows`, a row at a time: SQLite steps only as far as the caller reads."""
    names = [d[0] for d in cursor.description]
    return (dict(zip(names, row, strict=True)) for row in cursor)


def within_bytes(items: Iterable[T], size: Callable[[T], int], max_bytes: int) -> list[T]:
    """The items until their sizes add up to `max_bytes` (the last one taken may pass it; one is always taken): a
    read bounded in memory as well as in rows, the rest left for the next read."""
    taken, total = [], 0
    for item in items:
        taken.append(item)
        total += size(item)
        if total >= max_bytes:
            break
    return taken


def ms(seconds: float) -> int:
    return round(seconds * _MS)


class Database:
    def __init__(self, db: aiosqlite.Connection, path: Path, group_commit_max: int) -> None:
        self._db = db
        # Scans (stats, lists, counts for gauges and back-pressure) run on a read-only connection of their own:
        # on the writer's they would queue group commits behind a whole-table count.
        self._reader: aiosqlite.Connection | None = None
        self.path = path
        self.busy_timeout = 5.0  # as opened (`open`): other connections to the file wait as long
        self._group_commit_max = group_commit_max
        self._queue: asyncio.Queue[_Op | None] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self.stats = WriteStats()
        self._synchronous = self._sync_now = _FULL  # as configured, and as set now (`_prepare`, `_sync_for`)
        # False after a write failed for want of space or permission, until a write succeeds again (/readyz).
        self.writable = True

    # ---- open, migrate, close -------------------------------------------------------------------------------------

    @classmethod
    async def open(cls, path: str | Path, synchronous: str = "FULL", busy_timeout: float = 5.0,
                   group_commit_max: int = 2000) -> Database:
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
        store = cls(db, path, group_commit_max)
        store.busy_timeout = busy_timeout
        try:
            await store.in_thread(store._prepare, synchronous, busy_timeout)
        except Exception as e:  # also a broken install (no migrations folder): never leave the thread running
            await db.close()
            detail = str(e) if isinstance(e, sqlite3.Error | StoreError) else f"{type(e).__name__}: {e}"
            raise StoreError(f"{path}: {detail}") from e
        try:
            store._reader = await aiosqlite.connect(f"file:{path.resolve()}?mode=ro", uri=True, timeout=busy_timeout)
            store._reader.row_factory = sqlite3.Row
            await store._reader._execute(with_history_functions, store._reader._conn)  # type: ignore[no-untyped-call]
        except sqlite3.Error as e:
            await db.close()
            raise StoreError(f"{path}: cannot open a reader: {e}") from e
        store._writer = asyncio.get_running_loop().create_task(store._write_loop(), name="rdq-store-writer")
        return store

    def _prepare(self, synchronous: str, busy_timeout: float) -> None:
        conn = self.conn
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise StoreError(f"cannot switch the store to WAL mode (got {mode})")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        self._synchronous = self._sync_now = conn.execute("PRAGMA synchronous").fetchone()[0]
        conn.execute(f"PRAGMA busy_timeout={ms(busy_timeout)}")
        conn.execute("PRAGMA temp_store=MEMORY")
        with_history_functions(conn)
        self._migrate(conn)

    def _migrate(self, conn: sqlite3.Connection) -> None:
        current = conn.execute("PRAGMA user_version").fetchone()[0]
        known = migrations()
        if current > len(known):
            raise StoreError(f"the store has schema version {current}, newer than this rdq-bridge knows "
                             f"({len(known)}); upgrade rdq-bridge or use another store path")
        for version, name, sql in known[current:]:
            log.info("store: applying migration %s", name)
            conn.executescript(f"BEGIN IMMEDIATE;\n{sql}\nPRAGMA user_version={version};\nCOMMIT;")

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on aiosqlite's connection thread: a whole batch costs one hop, not one per statement. At the
        configured synchronous level, whatever the last group commit ran at (`_sync_for`)."""
        result: T = await self._db._execute(self._configured, fn, *args)  # type: ignore[no-untyped-call]
        return result

    def _configured(self, fn: Callable[..., T], *args: Any) -> T:
        self._sync_for(durable=True)
        return fn(*args)

    @property
    def conn(self) -> sqlite3.Connection:
        """The writer's connection, for code that already runs on its thread (inside `in_thread`, `write`)."""
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
            page = self.conn.execute("PRAGMA page_size").fetchone()[0]
            pages = 2**31 - 2 if max_bytes is None else max(1, max_bytes // page)
            self.conn.execute(f"PRAGMA max_page_count={int(pages)}")

        await self.in_thread(apply)

    async def size_bytes(self) -> int:
        return int(await self.read(lambda c: c.execute("PRAGMA page_count").fetchone()[0]
                                    * c.execute("PRAGMA page_size").fetchone()[0]))

    async def schema_version(self) -> int:
        return int(await self.read(lambda c: c.execute("PRAGMA user_version").fetchone()[0]))

    # ---- the group-commit writer -----------------------------------------------------------------------

    async def write(self, fn: Callable[[sqlite3.Connection], T], new_task: NewTask | None = None,
                    durable: bool = True) -> T:
        """`fn(conn)` in the next group commit, under its own savepoint; its result once COMMIT returned.
        `durable=False`: the write must survive the process, not the machine — a group commit of such writes
        alone is not fsync'd (the in-flight journal: what a handler that kills the process needs)."""
        return await self.enqueue(fn, new_task, durable)

    def enqueue(self, fn: Callable[[sqlite3.Connection], T], new_task: NewTask | None = None,
                durable: bool = True) -> asyncio.Future[T]:
        """Queue one write for the next group commit; its future is resolved by the writer."""
        if self._writer is None or self._writer.done():
            raise StoreError("the store is closed")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Op(fn, future, () if new_task is None else (new_task,), durable=durable))
        return future

    def enqueue_inserts(self, tasks: Sequence[NewTask], insert_one: Callable[[NewTask, sqlite3.Connection], object],
                        ) -> asyncio.Future[list[StoreError | None]]:
        """Queue new tasks as one write: inserted in bulk with the group commit's others, one future for all (a
        future and a callback a task were a tenth of the event loop's time on the failure path). Resolved with
        None a task stored, or the StoreError of a task that failed alone (`insert_one`, each under its own
        savepoint, once the bulk insert failed); failed as a whole when the commit fails."""
        if self._writer is None or self._writer.done():
            raise StoreError("the store is closed")
        future: asyncio.Future[list[StoreError | None]] = asyncio.get_running_loop().create_future()
        fallback = functools.partial(_insert_each, tuple(tasks), insert_one)
        self._queue.put_nowait(_Op(fallback, future, tuple(tasks), many=True))
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
            outcomes = await self._db._execute(self._run_batch, ops)  # type: ignore[no-untyped-call]
        except Exception as e:  # COMMIT failed (disk full, I/O error): nothing of the batch is durable.
            self.writable = False
            error = StoreError(f"{self.path}: write failed: {e}")
            for op in ops:
                if not op.future.done():
                    op.future.set_exception(error)
            return
        size = sum(len(op.new_tasks) if op.many else 1 for op in ops)  # a batch of inserts counts its tasks
        self.stats.batches += 1
        self.stats.synced += self._sync_now > _NORMAL
        self.stats.ops += size
        self.writable = not any(not ok and _unwritable(value) for ok, value in outcomes)
        self.stats.largest_batch = max(self.stats.largest_batch, size)
        for op, (ok, value) in zip(ops, outcomes, strict=True):
            if op.future.done():
                continue
            if ok:
                op.future.set_result(value)
            else:
                op.future.set_exception(value)

    def _run_batch(self, ops: Sequence[_Op]) -> list[tuple[bool, Any]]:
        conn = self.conn
        self._sync_for(any(op.durable for op in ops))
        conn.execute("BEGIN IMMEDIATE")
        try:
            results = self._apply_ops(conn, ops)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return results

    def _sync_for(self, durable: bool) -> None:
        """(Before BEGIN.) The configured synchronous level for a batch with a durable write in it; at most NORMAL
        for one without: at a few hundred records/s every poll's journal write was a commit of its own, an fsync
        a record for records that succeed. A durable batch after it syncs the WAL, the journal's frames with it."""
        wanted = self._synchronous if durable else min(self._synchronous, _NORMAL)
        if wanted != self._sync_now:
            self.conn.execute(f"PRAGMA synchronous={wanted}")
            self._sync_now = wanted

    def _apply_ops(self, conn: sqlite3.Connection, ops: Sequence[_Op]) -> list[tuple[bool, Any]]:
        results: list[tuple[bool, Any] | None] = [None] * len(ops)
        submits = [i for i, op in enumerate(ops) if op.new_tasks]
        tasks = [task for i in submits for task in ops[i].new_tasks]
        if len(tasks) > 1 and insert_batch(conn, tasks):
            for i in submits:
                op = ops[i]
                results[i] = (True, [None] * len(op.new_tasks) if op.many else op.new_tasks[0].id)
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
                results[i] = (False, _store_error(e))
        return [r for r in results if r is not None]

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return await self.in_thread(fn, self.conn)
        except sqlite3.Error as e:
            raise StoreError(f"{self.path}: read failed: {e}") from e

    async def scan(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """A read that may visit many rows: on the reader connection, never in the way of group commits."""
        assert self._reader is not None
        try:
            result: T = await self._reader._execute(fn, self._reader._conn)  # type: ignore[no-untyped-call]
            return result
        except sqlite3.Error as e:
            raise StoreError(f"{self.path}: read failed: {e}") from e
