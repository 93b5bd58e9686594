"""A batch of changelog records reduced to each task's last word, its rows packed as the store copies them.

Pure (no store, no Kafka): it runs on the restore thread, or in the decoding process (`decoder.py`), whose results
cross a pipe. The rows the store writes go as one value, a small SQLite database of their own (`Picked.rows`,
serialized), which the store attaches and copies from with `INSERT ... SELECT`: binding a task's ~32 values and
unpickling its tuples under the GIL was most of what the restoring process spent a task (13.4 us of CPU against
8.2 copied; RESULTS.md, "diagnostic: a restore batch bound by the store or packed by the decoder"). Per task only
what the store's checks ask crosses as Python objects (`Row`: its version and source record).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

from bridge.changelog.codec import Restored, Unreadable, decode
from bridge.store.bulk import insert_rows
from bridge.store.queries import q

Record = tuple[int, bytes | None, bytes | None]  # offset, key, value (None: a tombstone)

# The columns restore_tasks, restore_attempts and restore_redrives bind (queries.sql), in their order.
TASK_ROW = ("id", "queue", "handler_ref", "handler_version", "payload", "payload_content_type", "headers", "status",
            "attempt_count", "redrive_count", "next_attempt_at", "lease_expires_at", "lease_token", "lease_owner",
            "lease_started_at", "created_at", "life_started_at", "finished_at", "fetched_at", "dead_reason_type",
            "dead_reason_message", "dlq_state", "dlq_topic", "dlq_partition", "dlq_offset", "source_ref",
            "home_topic", "home_partition", "order_key", "order_seq", "order_hold")
ATTEMPT_ROW = ("task_id", "seq", "attempt_no", "redrive_no", "started_at", "finished_at", "outcome", "error_type",
               "error_message", "error_stack", "worker", "late_result_of", "note")
REDRIVE_ROW = ("task_id", "redrive_no", "at", "by", "request_id", "key_id")
_task_row, _redrive_row = (itemgetter(*names) for names in (TASK_ROW, REDRIVE_ROW))
_attempt_row = attrgetter(*ATTEMPT_ROW[1:])


class Row(NamedTuple):
    """What the store's checks ask of a restored task (`LocalIndex._replace`); its rows are in `Picked.rows`."""

    version: int
    source_ref: str | None


_Rows = tuple[tuple[Any, ...], bytes | None, tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...]]


def rows_of(restored: Restored) -> _Rows:
    """A restored task's rows: its tasks row (TASK_ROW, then the version), its history as one value (None: as
    attempts rows, see codec.Restored.history), its redrives."""
    task_id = restored.task["id"]
    attempts = () if restored.history is not None else tuple(
        (task_id, *_attempt_row(a)) for a in restored.attempts)
    return ((*_task_row(restored.task), restored.version), restored.history if restored.attempts else None,
            attempts, tuple(_redrive_row(r) for r in restored.redrives))


_packing = threading.local()  # a thread's connection for `pack` (restores in threads of one process run at once)


def pack(rows: list[_Rows]) -> bytes:
    """The tasks' rows as a database of their own (`restore_batch_schema`), serialized: one value to send and
    for the store to copy from. One connection a thread, emptied each time: a new one prepared its statements
    again for every batch (a statement of 512 rows' values is long to parse), which cost 12-14 us a task, not 5."""
    conn: sqlite3.Connection | None = getattr(_packing, "conn", None)
    if conn is None:
        conn = _packing.conn = sqlite3.connect(":memory:", isolation_level=None)
        conn.executescript(q("restore_batch_schema"))
    conn.execute("BEGIN")
    try:
        for table in ("tasks", "history", "attempts", "redrives"):
            conn.execute(f"DELETE FROM {table}")
        insert_rows(conn, "restore_batch_tasks", len(TASK_ROW) + 1, [r[0] for r in rows])
        insert_rows(conn, "restore_batch_history", 2, [(r[0][0], r[1]) for r in rows if r[1] is not None])
        insert_rows(conn, "restore_batch_attempts", len(ATTEMPT_ROW), [a for r in rows for a in r[2]])
        insert_rows(conn, "restore_batch_redrives", len(REDRIVE_ROW), [x for r in rows for x in r[3]])
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return conn.serialize()


@dataclass
class Picked:
    """Each task's last word in a batch (`pick_last`).

    `last`: each task's state (None: a tombstone); `held`: tasks whose last record cannot be read (offset, why;
    quarantined); `raw`: where in `records` each readable last record is; `unreadable`: every unreadable record
    (offset, key, value, why), kept in changelog_unreadable. `rows`: the rows of the tasks in `last` (`pack`).
    `records`: the batch (left empty by the decoding process: the restorer, which has it, puts it back instead of
    having it sent back)."""

    last: dict[str, Row | None]
    held: dict[str, tuple[int, str]]
    raw: dict[str, int]
    unreadable: list[tuple[int, bytes | None, bytes, str]]
    rows: bytes = field(default=b"", compare=False)  # its bytes differ with the packing's history; its rows do not
    records: list[Record] = field(default_factory=list)
    applied: int = 0
    tombstones: int = 0
    seconds: float = field(default=0.0, compare=False)  # spent decoding (in whichever thread or process did)

    def record_of(self, task_id: str) -> tuple[int, bytes | None, bytes]:
        offset, key, value = self.records[self.raw[task_id]]
        return offset, key, value or b""


def pick_last(records: list[Record], yield_every: int = 0, keep: bool = True) -> Picked:
    """Each task's last record of the batch, in log order. A later record holds a task's whole state, so only the
    last counts. `keep`: the batch is kept in `records` (not by the decoding process).

    `yield_every`: give the GIL up every that many records. The restore decodes on its own thread while the store's
    thread applies the batch before: that thread gives the GIL up in every SQLite step and, to take it back from a
    thread that does not give it up, waits a switch interval (5 ms) each time; measured, it applied 3x slower."""
    began = time.perf_counter()
    picked = Picked({}, {}, {}, [], records=records if keep else [])
    last, held = picked.last, picked.held
    rows: dict[str, _Rows] = {}
    for n, (offset, key, value) in enumerate(records):
        if yield_every and n % yield_every == 0:
            time.sleep(0)
        if value is None:
            task_id = (key or b"").decode("utf-8", "replace")
            last.pop(task_id, None)  # re-inserted at the end: the tombstone is its last word
            last[task_id] = None
            rows.pop(task_id, None)
            held.pop(task_id, None)
            picked.tombstones += 1
            continue
        try:
            restored = decode(key, value)
        except Unreadable as e:
            picked.unreadable.append((offset, key, value, str(e)))
            owner = _task_id_of(key)
            if owner is not None:
                last.pop(owner, None)
                rows.pop(owner, None)
                held[owner] = (offset, str(e))
            continue
        task_id = restored.task["id"]
        last.pop(task_id, None)
        last[task_id] = Row(restored.version, restored.task["source_ref"])
        rows[task_id] = rows_of(restored)
        held.pop(task_id, None)
        picked.raw[task_id] = n
        picked.applied += 1
    picked.rows = pack(list(rows.values()))
    picked.seconds = time.perf_counter() - began
    return picked


def _task_id_of(key: bytes | None) -> str | None:
    """The task an unreadable record is of: its record key (the task id; compaction keeps a key's last record)."""
    if not key:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None
