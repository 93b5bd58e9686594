"""The changelog writer's outbox read: on the store's reader thread, or, once the writer is busy, in a process of
its own (side.py) with its own read-only connection to the same file.

Why a process: SQLite builds each record in a step of its own and gives the GIL up for it; taking the GIL back
waits behind the lanes, the consumer and the store's writer thread, so beside them a round's read of 5,000 rows
took most of the writer's time (70 % of it on the failure path, at 17-20 µs a record alone: bench/RESULTS.md,
"diagnostic: a store read of many rows beside busy Python threads"). In a process of its own the steps take a GIL
no one else wants; the rows come back as one pickled list.

Nothing changes in what is read: the same query on a connection of the same file, which in WAL mode sees the last
committed state, as the reader connection does (`mark_logged` compares versions either way). A small read (a few
records: a quiet writer, the tests) stays on the thread: the process starts only once a round reads
PROCESS_FROM rows. And only where a core is to spare (more cores than bridge processes: `core_to_spare`): it
saves the GIL's waits but adds work (the rows pickled and sent), and beside `processes: 2` on 2 cores, the machine
busy, the failure path ran 1.19x one process with it against 1.41x without (bench/RESULTS.md, 2026-12-06).
Should it die or fail to start, the reads go back to the thread, and it is started again at the next large
round, at most MAX_STARTS times in a writer's life.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from typing import Any

from bridge.changelog.codec import with_payload
from bridge.changelog.side import SideProcess, SideProcessGone
from bridge.store.database import StoreError, within_bytes
from bridge.store.history import with_history_functions
from bridge.store.queries import q
from bridge.store.tasks import Store

log = logging.getLogger(__name__)
Row = tuple[str, str, int, int, bytes]  # task id, home topic, home partition, version, the changelog record
PROCESS_FROM = 1000  # rows in one round's read: from here the reads move to a process
MAX_STARTS = 3

_connection: sqlite3.Connection | None = None  # in the process: opened once, by `_open`


def outbox_rows(conn: sqlite3.Connection, params: dict[str, Any], max_bytes: int) -> list[Row]:
    """The outbox's records (`changelog_outbox_records`), each with its payload spliced in, up to `max_bytes`."""
    # Each record built by SQLite, attempts and redrives in (its steps give the GIL up, Python's encoding of the
    # same held it: 2-3x the time, while the lanes wait), the payload spliced in base64 here.
    with contextlib.closing(conn.execute(q("changelog_outbox_records"), params)) as rows:
        built = ((task_id, topic, partition, version, with_payload(record.encode(), payload))
                 for task_id, topic, partition, version, payload, record in rows)
        return within_bytes(built, lambda row: len(row[4]), max_bytes)


def _open(path: str, busy_timeout: float) -> None:
    global _connection
    _connection = with_history_functions(
        sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=busy_timeout, check_same_thread=False))


def _read_in_process(params: dict[str, Any], max_bytes: int) -> list[Row]:
    assert _connection is not None, "the outbox process was not opened"
    try:
        return outbox_rows(_connection, params, max_bytes)
    except sqlite3.Error as e:  # sent back as text: an sqlite3 error does not always survive pickling
        raise StoreError(str(e)) from None


class OutboxReader:
    """Reads the outbox where it is cheapest: see the module's docstring."""

    def __init__(self, store: Store, use_process: bool = True) -> None:
        self.store = store
        self.use_process = use_process
        self.process = SideProcess("changelog outbox read", _open,
                                   (str(store.db.path.resolve()), store.db.busy_timeout))
        self.starts = 0
        self.reads_in_process = 0

    async def read(self, params: dict[str, Any], max_bytes: int) -> list[Row]:
        if self.process.started and (failed := self.process.failed) is not None:
            log.warning("the changelog's outbox process did not start (%s: %s); reading on the store's thread",
                        type(failed).__name__, failed)
            self.process.close()
        if self.process.ready:
            try:
                rows = await self.process.run(_read_in_process, params, max_bytes)
                self.reads_in_process += 1
                return rows
            except StoreError as e:
                raise StoreError(f"{self.store.db.path}: read failed: {e}") from None
            except SideProcessGone as e:
                log.warning("the changelog's outbox process failed (%s); reading on the store's thread", e)
        rows = await self.store.db.scan(lambda conn: outbox_rows(conn, params, max_bytes))
        if self.use_process and len(rows) >= PROCESS_FROM and not self.process.started \
                and self.starts < MAX_STARTS:
            self.starts += 1
            self.process.start()
        return rows

    def close(self) -> None:
        self.process.close()
