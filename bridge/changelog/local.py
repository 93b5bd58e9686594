"""The SQLite side of the changelog: the outbox of unlogged transitions, the homes this instance owns, restore.

Every method is one store operation (group-committed like the others); encoding and decoding run on the store's
connection thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson

from bridge.changelog.codec import encode
from bridge.changelog.outbox_read import OutboxReader
from bridge.changelog.picking import ATTEMPT_ROW, REDRIVE_ROW, TASK_ROW, Picked, Record, Row, pick_last
from bridge.store.bulk import insert_rows
from bridge.store.database import within_bytes
from bridge.store.queries import q
from bridge.store.tasks import Store

Home = tuple[str, int]
# A round's records read at most this many bytes (the last one read may pass it; one is always read): 5,000 tasks
# of 1 KB payloads are ~11 MB, but a backlog of large ones (a record may be 8 MiB) read 5,000 at once held tens of
# gigabytes, and every restart read them again.
ROUND_BYTES = 16 * 1024 * 1024

class HomeState(Enum):
    """A partition's tasks in this file: this instance's to run (`ACTIVE`), being handed over (`LEAVING`: nothing
    new starts, their last transitions still go out), or not this instance's (`NOT_OURS`)."""

    ACTIVE = "active"
    LEAVING = "leaving"
    NOT_OURS = None


@dataclass(frozen=True)
class Entry:
    """One record for the changelog: a task's state at `version`, or (value None) a tombstone."""

    task_id: str
    home: Home
    version: int
    value: bytes | None


@dataclass
class RestoreBatch:
    applied: int = 0
    unreadable: int = 0
    tombstones: int = 0


@contextlib.contextmanager
def _guarded(conn: sqlite3.Connection) -> Iterator[None]:
    """A restore's writes replay the changelog's states: the store's release triggers stay still meanwhile (a
    held dead head deleted to be re-inserted is not purged; its parked record stays parked)."""
    conn.execute(q("restore_guard_on"))
    try:
        yield
    finally:
        conn.execute(q("restore_guard_off"))


class LocalIndex:
    def __init__(self, store: Store, outbox_process: bool = False) -> None:
        """`outbox_process`: a busy writer may read its outbox in a process of its own (outbox_read.py); only
        where a core is to spare (`core_to_spare`), or it takes one from the bridge processes."""
        self.store = store
        self.outbox_reader = OutboxReader(store, outbox_process)

    # ---- writing side ----------------------------------------------------------------------------------

    async def outbox(self, limit: int, skip: Iterable[str] = (), sent: Iterable[tuple[str, int]] = (),
                     max_bytes: int = ROUND_BYTES) -> list[Entry]:
        """Up to `limit` unlogged states and about `max_bytes` of records (ROUND_BYTES), but any of the tasks in
        `skip` and the states `sent` (task id, version): both left out before they are built."""
        params = {"limit": limit, "skip": orjson.dumps(list(skip)).decode(),
                  "sent": orjson.dumps([f"{task_id} {version}" for task_id, version in sent]).decode()}
        # Never on the writer's connection: reading and encoding thousands of tasks must not hold up its group
        # commits (WAL: the read sees the last committed state; `mark_logged` compares versions).
        rows = await self.outbox_reader.read(params, max_bytes)
        return [Entry(task_id, (topic, partition), version, value)
                for task_id, topic, partition, version, value in rows]

    def close(self) -> None:
        """The outbox's process, if one was started, goes (outbox_read.py)."""
        self.outbox_reader.close()

    async def premigration(self, limit: int, max_bytes: int = ROUND_BYTES) -> list[Entry]:
        """Tasks stored before the changelog existed (any partition): the first start writes them to it. Up to
        `limit` of them and about `max_bytes` of records, as a round reads (a file of large tasks is not read
        5,000 at once: gigabytes, again at every start until written)."""

        def read(conn: sqlite3.Connection) -> list[Entry]:
            with contextlib.closing(conn.execute(q("premigration_outbox"), {"limit": limit})) as rows:
                entries = (self._entry(conn, row) for row in rows)
                return within_bytes(entries, lambda e: len(e.value or b""), max_bytes)

        return await self.store.db.read(read)

    async def snapshot_published(self, task_id: str, topic: str, partition: int, offset: int,
                                 now: int) -> Entry | None:
        """The state a DLQ publish leads to (what `mark_dlq_published` will write), for the same transaction."""

        def read(conn: sqlite3.Connection) -> Entry | None:
            row = conn.execute(q("get_task"), {"id": task_id}).fetchone()
            if row is None or row["home_topic"] is None:
                return None
            published = {"dlq_state": "PUBLISHED", "dlq_topic": topic, "dlq_partition": partition,
                         "dlq_offset": offset, "fetched_at": row["fetched_at"] or now}
            return self._entry(conn, row, row["version"] + 1, published)

        return await self.store.db.read(read)

    @staticmethod
    def _entry(conn: sqlite3.Connection, row: sqlite3.Row, version: int | None = None,
               overrides: dict[str, Any] | None = None) -> Entry:
        attempts = conn.execute(q("get_attempts"), {"id": row["id"]}).fetchall()
        redrives = conn.execute(q("get_redrives"), {"id": row["id"]}).fetchall()
        version = row["version"] if version is None else version
        value = encode(row, attempts, redrives, version, overrides)
        return Entry(row["id"], (row["home_topic"], row["home_partition"]), version, value)

    async def tombstones(self, limit: int) -> list[Entry]:
        rows = await self.store.db.read(lambda c: c.execute(q("tombstones_due"), {"limit": limit}).fetchall())
        return [Entry(r[0], (r[1], r[2]), 0, None) for r in rows]

    async def mark_logged(self, entries: Iterable[Entry]) -> None:
        await self.mark_logged_soon(entries)

    def mark_logged_soon(self, entries: Iterable[Entry]) -> asyncio.Future[None]:
        """The marks queued for the next group commit now (in order with every write queued after them); the
        future is resolved when it committed."""
        entries = list(entries)
        highest: dict[str, int] = {}
        for e in entries:
            if e.value is not None and e.version > highest.get(e.task_id, -1):
                highest[e.task_id] = e.version
        marks = {"marks": orjson.dumps(highest).decode()}
        gone = {"ids": orjson.dumps([e.task_id for e in entries if e.value is None]).decode()}

        def apply(conn: sqlite3.Connection) -> None:
            conn.execute(q("changelog_logged"), marks)
            conn.execute(q("tombstone_done"), gone)

        return self.store.db.enqueue(apply)

    async def unlogged(self, ids: Iterable[str]) -> set[str]:
        """Of these tasks, those with a transition the changelog has not acknowledged."""
        wanted = {"ids": orjson.dumps(list(ids)).decode()}

        def read(conn: sqlite3.Connection) -> set[str]:
            return {row[0] for row in conn.execute(q("changelog_unlogged_of"), wanted)}

        return await self.store.db.scan(read)

    # ---- homes -----------------------------------------------------------------------------------------

    async def set_changelogged(self, topics: Iterable[str]) -> None:
        """The source topics with a changelog: their tasks are acted on only where their partition is active."""
        params = [{"topic": t} for t in topics]

        def apply(conn: sqlite3.Connection) -> None:
            conn.execute(q("changelogged_clear"))
            conn.executemany(q("changelogged_add"), params)

        await self.store.db.write(apply)

    async def set_home(self, home: Home, state: HomeState) -> None:
        """What this file's copy of a partition's tasks is now (the store scopes claims, timeouts and purges by
        it)."""
        query = {HomeState.ACTIVE: "home_activate", HomeState.LEAVING: "home_leaving",
                 HomeState.NOT_OURS: "home_deactivate"}[state]
        params = {"topic": home[0], "partition": home[1]}
        await self.store.db.write(lambda c: c.execute(q(query), params))

    async def drop_home(self, home: Home) -> int:
        """Remove a partition's tasks from this file (its changelog holds them; the new owner restores them)."""
        params = {"topic": home[0], "partition": home[1]}

        def apply(conn: sqlite3.Connection) -> int:
            conn.execute(q("home_deactivate"), params)
            conn.execute(q("home_drop_tombstones"), params)
            conn.execute(q("restore_pending_clear"), params)  # a restore of it given up left its rows
            ids = [r[0] for r in conn.execute(q("home_drop_tasks"), params).fetchall()]
            for task_id in ids:
                conn.execute(q("delete_attempts"), {"id": task_id})
                conn.execute(q("delete_redrives"), {"id": task_id})
            return len(ids)

        return await self.store.db.write(apply)

    async def homes_present(self) -> set[Home]:
        rows = await self.store.db.read(lambda c: c.execute(q("homes_present")).fetchall())
        return {(r[0], r[1]) for r in rows}

    # ---- restore ---------------------------------------------------------------------------------------

    async def restore_begin(self, home: Home) -> None:
        """A restore of this partition from the beginning of its changelog starts: what this file had logged of it
        is what the restore has yet to find (table restore_pending; `restore_finish` drops what it never found).
        Kept on disk, not in memory: a million restored ids held in a set were a hundred MiB."""
        params = {"topic": home[0], "partition": home[1]}

        def apply(conn: sqlite3.Connection) -> None:
            conn.execute(q("restore_pending_clear"), params)
            conn.execute(q("restore_pending_begin"), params)

        await self.store.db.write(apply)

    async def restore_batch(self, home: Home, changelog_topic: str, records: list[Record] | Picked, now: int,
                            errors: list[str]) -> RestoreBatch:
        """Apply changelog records in log order: the changelog wins over this file. A record that cannot be read
        is kept (table changelog_unreadable) and counted, never dropped silently, and does not stop the restore;
        its task is quarantined (`_quarantine`): not restored from its earlier records.

        In bulk: only each task's last record in the batch counts (a later one holds its whole state), and the
        batch's tasks are replaced with a few `executemany`, not statement by statement. `records` may come
        already picked (`pick_last`, done by the restorer while the store applies the previous batch)."""
        result = RestoreBatch()
        params = {"topic": home[0], "partition": home[1]}

        def apply(conn: sqlite3.Connection) -> RestoreBatch:
            picked = records if isinstance(records, Picked) else pick_last(records)
            last, held = picked.last, picked.held
            for offset, key, value, why in picked.unreadable:
                self._unreadable(conn, changelog_topic, home[1], offset, key, value, why, now, errors)
            result.applied, result.tombstones, result.unreadable = (picked.applied, picked.tombstones,
                                                                    len(picked.unreadable))
            with _guarded(conn):
                refused = self._replace(conn, last)
                for task_id, why in refused.items():
                    offset, key, value = picked.record_of(task_id)
                    self._unreadable(conn, changelog_topic, home[1], offset, key, value, why, now, errors)
                    held[task_id] = (offset, why)
                    del last[task_id]
                    result.applied -= 1
                    result.unreadable += 1
                self._quarantine(conn, changelog_topic, home[1], held, now)
            # One statement each for the batch: the restore is a partition's downtime.
            found = orjson.dumps([*last, *held]).decode()
            conn.execute(q("quarantine_end"), {"ids": orjson.dumps(list(last)).decode()})
            conn.execute(q("restore_pending_found"), {**params, "ids": found})
            return result

        return await self.store.db.write(apply)

    @staticmethod
    def _unreadable(conn: sqlite3.Connection, topic: str, partition: int, offset: int, key: bytes | None,
                    value: bytes, why: str, now: int, errors: list[str]) -> None:
        conn.execute(q("unreadable_add"), {"topic": topic, "partition": partition, "offset": offset, "key": key,
                                           "value": value, "error": why, "now": now})
        errors.append(f"{topic}/{partition}/{offset}: {why}")

    def _quarantine(self, conn: sqlite3.Connection, topic: str, partition: int, held: dict[str, tuple[int, str]],
                    now: int) -> None:
        """Tasks whose last changelog record this bridge cannot read: their earlier state must not win (a DEAD,
        published task would come back PENDING and be dead-lettered twice), so the local copy goes and the task
        is held in changelog_quarantine (not runnable; `rdq stats`) until a record it can read, or a tombstone,
        comes. The record stays in the changelog (compaction keeps a key's last record) for a bridge that reads
        it."""
        for task_id, (offset, why) in held.items():
            self._delete(conn, task_id)
            conn.execute(q("quarantine_add"), {"task_id": task_id, "topic": topic, "partition": partition,
                                               "offset": offset, "error": why, "now": now})

    def _replace(self, conn: sqlite3.Connection, last: dict[str, Row | None]) -> dict[str, str]:
        """Replace these tasks by their changelog states (None: a tombstone); those this file does not hold are
        new here: nothing to delete first. Returns the records the store refused (a rule of its schema broken:
        task id → why), restored as none.

        The higher version wins, the changelog's at a tie: a transition this file made and the changelog never
        acknowledged (a claim written just before the handler killed the process) is newer than the changelog's
        state and stays, to be logged now. Letting the changelog's older PENDING win forgot the claim, so the
        lapsed lease was never counted and a poison pill retried for ever."""
        local = dict(conn.execute(q("versions_of"), {"ids": orjson.dumps(list(last)).decode()}).fetchall())
        newer_here = {i for i, r in last.items() if r is not None and local.get(i, -1) > r.version}
        if newer_here:
            last = {i: r for i, r in last.items() if i not in newer_here}
        ids = [{"id": i} for i in last if i in local]
        conn.executemany(q("delete_attempts"), ids)
        conn.executemany(q("delete_redrives"), ids)
        conn.executemany(q("delete_task"), ids)
        kept = [r for r in last.values() if r is not None]
        # A local task for the same source record under another id gives way (the changelog wins).
        refs = [r.source_ref for r in kept if r.source_ref is not None]
        for start in range(0, len(refs), 500):
            chunk = refs[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for (twin,) in conn.execute(q("source_ref_holders").replace(":refs", marks), chunk).fetchall():
                self._delete(conn, twin)
        conn.execute("SAVEPOINT restore_insert")
        try:
            self._insert(conn, kept)
        except sqlite3.IntegrityError:
            # One record breaks a rule the codec does not know of: the others are restored one by one.
            conn.execute("ROLLBACK TO restore_insert")
            return self._insert_each(conn, kept)
        finally:
            conn.execute("RELEASE restore_insert")
        return {}

    @staticmethod
    def _insert(conn: sqlite3.Connection, kept: list[Row]) -> None:
        """Many rows a statement, bound by position (`bulk.insert_rows`): the restore is a partition's downtime,
        and statement by statement with named parameters was most of its store time. A task's history is one row
        (restored_attempts, read through attempt_history): five attempt rows a task were most of what was left."""
        insert_rows(conn, "restore_tasks", len(TASK_ROW) + 1, [r.task for r in kept])
        insert_rows(conn, "restore_history", 2, [(r.task[0], r.history) for r in kept if r.history is not None])
        insert_rows(conn, "restore_attempts", len(ATTEMPT_ROW), [a for r in kept for a in r.attempts])
        insert_rows(conn, "restore_redrives", len(REDRIVE_ROW), [x for r in kept for x in r.redrives])

    def _insert_each(self, conn: sqlite3.Connection, kept: list[Row]) -> dict[str, str]:
        refused = {}
        for restored in kept:
            conn.execute("SAVEPOINT restore_one")
            try:
                self._insert(conn, [restored])
            except sqlite3.IntegrityError as e:
                conn.execute("ROLLBACK TO restore_one")
                refused[restored.task[0]] = f"the store refused it: {e}"
            finally:
                conn.execute("RELEASE restore_one")
        return refused

    @staticmethod
    def _delete_history(conn: sqlite3.Connection, task_id: str) -> None:
        conn.execute(q("delete_attempts"), {"id": task_id})
        conn.execute(q("delete_redrives"), {"id": task_id})

    def _delete(self, conn: sqlite3.Connection, task_id: str) -> None:
        conn.execute(q("delete_task"), {"id": task_id})
        self._delete_history(conn, task_id)

    async def restore_finish(self, home: Home) -> int:
        """After a restore from the beginning (`restore_begin`, then every batch): a task this file had logged
        that the changelog no longer holds was purged (its tombstone compacted away): it goes. A task never logged
        stays, to be logged now (a first start with the changelog on; or written just before a crash, its source
        offset not committed)."""
        params = {"topic": home[0], "partition": home[1]}

        def apply(conn: sqlite3.Connection) -> int:
            gone = [r[0] for r in conn.execute(q("restore_pending_gone"), params).fetchall()]
            with _guarded(conn):
                for task_id in gone:
                    self._delete(conn, task_id)
            conn.execute(q("restore_pending_clear"), params)
            return len(gone)

        return await self.store.db.write(apply)

    async def partitions_status(self) -> dict[str, dict[str, int]]:
        rows = await self.store.db.scan(lambda c: c.execute(q("partitions_status")).fetchall())
        return {f"{r[0]}/{r[1]}": {"open": r[2], "changelog_lag": r[3]} for r in rows}

    async def quarantined_counts(self) -> dict[str, int]:
        rows = await self.store.db.scan(lambda c: c.execute(q("quarantine_count")).fetchall())
        return {f"{r[0]}/{r[1]}": r[2] for r in rows}

    async def unreadable_counts(self) -> dict[str, int]:
        rows = await self.store.db.scan(lambda c: c.execute(q("unreadable_count")).fetchall())
        return {f"{r[0]}/{r[1]}": r[2] for r in rows}
