"""Many rows in one INSERT: SQLite steps once for a chunk of rows instead of once a row.

`executemany` steps each row apart, and every step gives the GIL up and takes it back; with the lanes and the
changelog writer busy in Python meanwhile, taking it back was most of a group commit's time (the failure path's
bound: the store's writer thread). A chunk of rows bound into one statement is one step.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from functools import cache
from typing import Any

from bridge.model import Attempt, NewTask, Status, home_of
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


TASK_WIDTH, ATTEMPT_WIDTH = 19, 12  # the values of one row of insert_tasks_unordered, of insert_first_attempts


def task_row(task: NewTask) -> tuple[Any, ...]:
    """`task.params()` of a task without an order key, in the columns' order of `insert_tasks_unordered`."""
    dead = task.status == Status.DEAD
    home = home_of(task.headers)
    reason = task.dead_reason
    return (task.id, task.queue, task.handler_ref, task.handler_version, task.payload, task.payload_content_type,
            json.dumps(task.headers, separators=(",", ":")), task.status.value, 1 if task.first_attempt else 0,
            None if dead else task.next_attempt_at, task.created_at, task.created_at,
            task.created_at if dead else None, reason.type if reason else None, reason.message if reason else None,
            "PENDING" if dead else None, task.source_ref, home[0] if home else None, home[1] if home else None)


def attempt_row(attempt: Attempt, task_id: str) -> tuple[Any, ...]:
    """`attempt.params(task_id)` in the columns' order of `insert_first_attempts`."""
    error = attempt.error
    return (task_id, attempt.attempt_no, attempt.redrive_no, attempt.started_at, attempt.finished_at,
            attempt.outcome.value, error.type if error else None, error.message if error else None,
            error.stack if error else None, attempt.worker, attempt.late_result_of, attempt.note)
