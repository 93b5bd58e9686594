"""Many rows in one INSERT: SQLite steps once for a chunk of rows instead of once a row.

`executemany` steps each row apart, and every step gives the GIL up and takes it back; with the lanes and the
changelog writer busy in Python meanwhile, taking it back was most of a group commit's time (the failure path's
bound: the store's writer thread). A chunk of rows bound into one statement is one step.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from functools import cache
from typing import Any

from bridge.model import Attempt, NewTask
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


# The columns of insert_tasks_unordered and insert_first_attempts, in their order: a row is taken from `params()`,
# never written out a second time.
_TASK_COLUMNS = ("id", "queue", "handler_ref", "handler_version", "payload", "payload_content_type", "headers",
                 "status", "attempt_count", "next_attempt_at", "created_at", "created_at", "finished_at",
                 "dead_reason_type", "dead_reason_message", "dlq_state", "source_ref", "home_topic", "home_partition")
_ATTEMPT_COLUMNS = ("task_id", "attempt_no", "redrive_no", "started_at", "finished_at", "outcome", "error_type",
                    "error_message", "error_stack", "worker", "late_result_of", "note")
TASK_WIDTH, ATTEMPT_WIDTH = len(_TASK_COLUMNS), len(_ATTEMPT_COLUMNS)


def task_row(task: NewTask) -> tuple[Any, ...]:
    """A task without an order key as `insert_tasks_unordered` binds it (life_started_at = created_at)."""
    params = task.params()
    return tuple(params[name] for name in _TASK_COLUMNS)


def attempt_row(attempt: Attempt, task_id: str) -> tuple[Any, ...]:
    """A first attempt as `insert_first_attempts` binds it."""
    params = attempt.params(task_id)
    return tuple(params[name] for name in _ATTEMPT_COLUMNS)
