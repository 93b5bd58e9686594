"""`rdq store …`: read a store file directly (read-only), for when Kafka is down."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from bridge.model import Attempt, Status, Task
from bridge.store.database import StoreError
from bridge.store.queries import q


class StoreReader:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.exists():
            raise StoreError(f"{path}: no such store file")
        # Read-only: safe beside a running bridge (WAL lets readers and the writer proceed together).
        self.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        self.conn.row_factory = sqlite3.Row

    def counts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for queue, status, n in self.conn.execute(q("count_by_queue_status")):
            out.setdefault(queue, {s.value: 0 for s in Status})[status] = n
        return out

    def get(self, task_id: str) -> Task | None:
        row = self.conn.execute(q("get_task"), {"id": task_id}).fetchone()
        if row is None:
            return None
        attempts = tuple(Attempt.from_row(r) for r in self.conn.execute(q("get_attempts"), {"id": task_id}))
        return Task.from_row(row, attempts)

    def redrives(self, task_id: str) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute(q("get_redrives"), {"id": task_id})]

    def list(self, queue: str | None, status: str | None, limit: int, error_type: str | None = None) -> list[Task]:
        rows = self.conn.execute(q("list_tasks"), {"queue": queue, "status": status, "limit": limit,
                                                   "error_type": error_type})
        return [Task.from_row(r) for r in rows]

    def close(self) -> None:
        self.conn.close()
