"""`rdq store …`: read a store file directly (read-only), for when Kafka is down — with the store's own reads."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from bridge.model import Task
from bridge.store.database import StoreError
from bridge.store.history import with_history_functions
from bridge.store.reads import read_counts, read_list, read_redrives, read_task


class StoreReader:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.exists():
            raise StoreError(f"{path}: no such store file")
        # Read-only: safe beside a running bridge (WAL lets readers and the writer proceed together).
        self.conn = with_history_functions(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5))
        self.conn.row_factory = sqlite3.Row

    def counts(self) -> dict[str, dict[str, int]]:
        return read_counts(self.conn)

    def get(self, task_id: str) -> Task | None:
        return read_task(self.conn, task_id)

    def redrives(self, task_id: str) -> list[dict[str, Any]]:
        return read_redrives(self.conn, task_id)

    def list(self, queue: str | None, status: str | None, limit: int, error_type: str | None = None) -> list[Task]:
        return read_list(self.conn, queue, status, limit, error_type)

    def close(self) -> None:
        self.conn.close()
