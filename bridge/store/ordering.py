"""Per-key order in the store (SPEC §12): open keys, a key's head, parked records, skip."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from typing import Any

from bridge.model import Task
from bridge.store.database import Database
from bridge.store.queries import q


class KeyOrder:
    db: Database  # the store's parts share its database and scope (Store.__init__)
    scoped: bool

    # ---- ordering: key (SPEC §12) ----------------------------------------------------------------------

    async def skip(self, task_id: str) -> str | None:
        """A dead head holding its key (on_dead: hold) lets it go: the key's next parked task becomes due (the
        release trigger, same transaction). Returns the key, or None when the task is not such a head."""

        def apply(conn: sqlite3.Connection) -> str | None:
            row = conn.execute(q("order_skip"), {"id": task_id}).fetchone()
            return None if row is None else str(row[0])

        return await self.db.write(apply)

    async def order_open_keys(self, topic: str, partition: int, queue: str) -> set[str]:
        """The keys of a partition that hold back their later records (a task running, due, parked or holding)."""
        params = {"topic": topic, "partition": partition, "queue": queue}
        rows = await self.db.write(lambda c: c.execute(q("order_open_keys"), params).fetchall())
        return {r[0] for r in rows}

    async def order_open_of(self, keys: Iterable[str]) -> set[str]:
        """Which of `keys` still hold back their later records. On the writer: after every write submitted
        before it (a key must not look free while its task is on its way into the store)."""
        params = {"keys": json.dumps(list(keys))}
        rows = await self.db.write(lambda c: c.execute(q("order_open_of"), params).fetchall())
        return {r[0] for r in rows}

    async def order_keys_of(self, ids: Iterable[str]) -> set[str]:
        """The ordering keys of these tasks (those of queues with ordering: key)."""
        params = {"ids": json.dumps(list(ids))}
        rows = await self.db.read(lambda c: c.execute(q("order_keys_of"), params).fetchall())
        return {r[0] for r in rows}

    async def order_head(self, task: Task) -> dict[str, Any] | None:
        """What a parked task waits behind: its key's earliest task not parked and not finished (or holding)."""
        if task.order_key is None:
            return None
        params = {"order_key": task.order_key, "id": task.id}
        row = await self.db.read(lambda c: c.execute(q("order_head"), params).fetchone())
        return None if row is None else {"id": row[0], "status": row[1]}

    async def parked_behind(self, order_key: str) -> int:
        return int(await self.db.read(lambda c: c.execute(q("order_parked_behind"),
                                                         {"order_key": order_key}).fetchone()[0]))

    async def parked_stats(self) -> dict[str, tuple[int, int]]:
        """Per queue: (parked tasks, the oldest one's parking time in ms)."""
        rows = await self.db.scan(lambda c: c.execute(q("parked_oldest")).fetchall())
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}

    async def mark_fetched(self, task_id: str, now: int) -> bool:
        params = {"id": task_id, "now": now}
        return await self.db.write(lambda c: c.execute(q("mark_fetched"), params).rowcount == 1)
