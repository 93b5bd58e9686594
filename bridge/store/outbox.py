"""The DLQ outbox (SPEC §5.3): DEAD tasks not yet published, their failures and marks, the store's secrets."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable

from bridge.model import Task
from bridge.store.database import Database, dict_rows
from bridge.store.queries import q
from bridge.store.reads import attempts_of_many


class DlqOutbox:
    db: Database  # the store's parts share its database and scope (Store.__init__)
    scoped: bool

    # ---- DLQ outbox ------------------------------------------------------------------------------------

    async def dlq_outbox(self, limit: int = 500, now: int | None = None, skip: Iterable[str] = ()) -> list[Task]:
        """Unpublished DEAD tasks due for a (re)try at `now` (None: all of them), but those in `skip` (on their
        way already: reading them again, attempts and payload, cost the publisher most of its time)."""
        params = {"limit": limit, "now": 2**62 if now is None else now, "scoped": self.scoped,
                  "skip": json.dumps(list(skip))}

        def read(conn: sqlite3.Connection) -> list[Task]:
            rows = dict_rows(conn.execute(q("dlq_outbox"), params))
            attempts = attempts_of_many(conn, [r["id"] for r in rows])
            return [Task.from_row(r, attempts.get(r["id"], ()), r["parked_behind"]) for r in rows]

        # On the reader connection: on the writer's it waited behind the "published" marks of the batch before
        # (71% of the publisher's time, bench_kafka dlq). Safe: an entry leaves the publisher's pending set only
        # after its mark committed, so a later read sees it published.
        return await self.db.scan(read)

    async def dlq_publish_failed(self, task_id: str, error: str, next_at: int) -> bool:
        """This entry's publish failed: it waits until `next_at`; the others do not wait for it."""
        params = {"id": task_id, "error": error[:2000], "next_at": next_at}
        return await self.db.write(lambda c: c.execute(q("dlq_publish_failed"), params).rowcount == 1)

    async def dlq_stuck(self) -> dict[str, dict[str, int]]:
        """By queue: how many outbox entries failed their last publish, and the most tries of one."""
        rows = await self.db.scan(lambda c: c.execute(q("dlq_stuck_by_queue")).fetchall())
        return {r["queue"]: {"entries": r["n"], "most_failures": r["most_failures"]} for r in rows}

    async def secret(self, name: str, make: Callable[[], bytes]) -> bytes:
        """The bridge's secret `name`, made once with `make` and kept in the store (it outlives restarts)."""
        candidate = make()

        def apply(conn: sqlite3.Connection) -> bytes:
            conn.execute(q("secret_put"), {"name": name, "value": candidate})
            return bytes(conn.execute(q("secret_get"), {"name": name}).fetchone()[0])

        return await self.db.write(apply)

    async def mark_dlq_published(self, task: Task, topic: str, partition: int, offset: int, now: int,
                                 logged: bool = False) -> bool:
        """`logged`: this very state went to the changelog with the DLQ record, in one Kafka transaction."""
        params = {"id": task.id, "topic": topic, "partition": partition, "offset": offset, "now": now,
                  "redrive_count": task.redrive_count, "logged": logged}
        return await self.db.write(lambda c: c.execute(q("mark_dlq_published"), params).rowcount == 1)
