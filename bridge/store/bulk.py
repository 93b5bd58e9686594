"""Many rows in one INSERT: SQLite steps once for a chunk of rows instead of once a row.

`executemany` steps each row apart, and every step gives the GIL up and takes it back; with the lanes and the
changelog writer busy in Python meanwhile, taking it back was most of a group commit's time (the failure path's
bound: the store's writer thread). A chunk of rows bound into one statement is one step.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Sequence
from functools import cache
from typing import Any

from bridge.model import Attempt, NewTask, Status, headers_json, home_of
from bridge.store.queries import q

_CHUNKS = (512, 256, 128, 64, 32, 16, 8, 4, 2, 1)  # a batch is cut greedily: few statement texts, each cached


def insert_rows(conn: sqlite3.Connection, query: str, width: int, rows: Sequence[tuple[Any, ...]]) -> None:
    """Run the named `query` (its `:rows` stands for the VALUES rows, `width` values each) over `rows`."""
    most = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // width
    start = 0
    for size in _CHUNKS:
        if size > most:
            continue
        while len(rows) - start >= size:
            chunk = rows[start : start + size]
            conn.execute(_statement(query, width, size), [value for row in chunk for value in row])
            start += size


@cache
def _statement(query: str, width: int, size: int) -> str:
    row = "(" + ",".join("?" * width) + ")"
    return q(query).replace(":rows", ",".join([row] * size))


# The columns of insert_tasks_unordered and insert_first_attempts, in the order `task_row` and `attempt_row` give
# them (life_started_at is created_at); tests/test_store.py holds each row equal to its `params()` so named.
NEW_TASK_COLUMNS = ("id", "queue", "handler_ref", "handler_version", "payload", "payload_content_type", "headers",
                    "status", "attempt_count", "next_attempt_at", "created_at", "created_at", "finished_at",
                    "dead_reason_type", "dead_reason_message", "dlq_state", "source_ref", "home_topic",
                    "home_partition")
ATTEMPT_COLUMNS = ("task_id", "attempt_no", "redrive_no", "started_at", "finished_at", "outcome", "error_type",
                   "error_message", "error_stack", "worker", "late_result_of", "note")
TASK_WIDTH, ATTEMPT_WIDTH = len(NEW_TASK_COLUMNS), len(ATTEMPT_COLUMNS)


def task_row(task: NewTask) -> tuple[Any, ...]:
    """`task.params()`'s values in NEW_TASK_COLUMNS' order, written out rather than taken from the dict: the
    store's writer thread makes one a new task, holding the GIL the lanes want (6.2 µs through the dict, 3.2 so;
    with `attempt_row`, the failure path 0.50-0.51 of executemany before, 0.54 after: bench/RESULTS.md)."""
    dead = task.status == Status.DEAD
    reason, headers, created = task.dead_reason, task.headers, task.created_at
    source = headers.get("rdq.source")
    home = home_of(headers)
    return (task.id, task.queue, task.handler_ref, task.handler_version, task.payload, task.payload_content_type,
            headers_json(headers), task.status.value, 1 if task.first_attempt and task.first_attempt_counted else 0,
            None if dead else task.next_attempt_at, created, created, created if dead else None,
            reason.type if reason else None, reason.message if reason else None, "PENDING" if dead else None,
            None if source is None else f"{source}@{headers.get('rdq.kafka.timestamp', '')}",
            home[0] if home else None, home[1] if home else None)


def attempt_row(attempt: Attempt, task_id: str) -> tuple[Any, ...]:
    """`attempt.params(task_id)`'s values in ATTEMPT_COLUMNS' order, written out (2.8 µs through the dict, 0.6)."""
    error = attempt.error
    return (task_id, attempt.attempt_no, attempt.redrive_no, attempt.started_at, attempt.finished_at,
            attempt.outcome.value, error.type if error else None, error.message if error else None,
            error.stack if error else None, attempt.worker, attempt.late_result_of, attempt.note)


def insert_batch(conn: sqlite3.Connection, tasks: list[NewTask]) -> bool:
    """A group commit's new tasks and their first attempts, in bulk, under a savepoint. False: a row failed and
    none is inserted (the caller inserts them one by one, so the bad one fails alone)."""
    conn.execute("SAVEPOINT bulk")
    try:
        # In the batch's order (the first of two tasks for one record wins), runs of tasks without an order
        # key at once, those with one by insert_task's parking rules.
        for unordered, run in itertools.groupby(tasks, key=lambda t: t.order_key is None):
            if unordered:
                insert_rows(conn, "insert_tasks_unordered", TASK_WIDTH, [task_row(t) for t in run])
            else:
                conn.executemany(q("insert_task"), [t.params() for t in run])
        insert_rows(conn, "insert_first_attempts", ATTEMPT_WIDTH,
                    [attempt_row(t.first_attempt, t.id) for t in tasks if t.first_attempt is not None])
        conn.execute("RELEASE bulk")
        return True
    except Exception:  # sqlite3.Error, or e.g. OverflowError binding a value too large for an INTEGER
        if not conn.in_transaction:
            raise  # SQLite rolled the whole transaction back (e.g. SQLITE_FULL): the batch fails as one
        # A bad row (a duplicate id, a value SQLite cannot hold) fails alone on the one-by-one path.
        conn.execute("ROLLBACK TO bulk")
        conn.execute("RELEASE bulk")
        return False
