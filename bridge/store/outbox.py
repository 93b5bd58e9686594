"""The DLQ outbox (SPEC §5.3): DEAD tasks not yet published, their failures and marks, the store's secrets."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterable
from typing import NamedTuple

from bridge.model import Task
from bridge.store.database import Database, dict_rows, iter_dict_rows, within_bytes
from bridge.store.queries import q
from bridge.store.reads import attempts_of_many

BATCH_PAYLOAD_BYTES = 16 * 1024 * 1024  # a DLQ batch's payloads read at once, at most about this many bytes


class OutboxEntry(NamedTuple):
    """An unpublished DEAD task as the publisher needs it: the task (its `attempts` not read) and its attempts as
    the JSON objects its envelope carries, oldest first, encoded by SQLite (attempts_json_of_many)."""

    task: Task
    attempts_json: list[str]


def _with_rare_fields(body: str, late_result_of: int | None, note: str | None) -> str:
    """An attempt's JSON object with its late_result_of and note, when set, as Attempt.to_json puts them."""
    rare: dict[str, int | str] = {"late_result_of": late_result_of} if late_result_of is not None else {}
    if note is not None:
        rare["note"] = note
    return body[:-1] + "," + json.dumps(rare, ensure_ascii=False, separators=(",", ":"))[1:]


class DlqOutbox:
    db: Database  # the store's parts share its database and scope (Store.__init__)
    scoped: bool

    # ---- DLQ outbox ------------------------------------------------------------------------------------

    async def dlq_outbox(self, limit: int = 500, now: int | None = None, skip: Iterable[str] = ()) -> list[Task]:
        """Unpublished DEAD tasks due for a (re)try at `now` (None: all of them), but those in `skip` (on their
        way already: reading them again, attempts and payload, cost the publisher most of its time)."""
        params = self._outbox_params(limit, now, skip)

        def read(conn: sqlite3.Connection) -> list[Task]:
            rows = dict_rows(conn.execute(q("dlq_outbox"), params))
            attempts = attempts_of_many(conn, [r["id"] for r in rows])
            return [Task.from_row(r, attempts.get(r["id"], ()), r["parked_behind"]) for r in rows]

        # On the reader connection: on the writer's it waited behind the "published" marks of the batch before
        # (71% of the publisher's time, bench_kafka dlq). Safe: an entry leaves the publisher's pending set only
        # after its mark committed, so a later read sees it published.
        return await self.db.scan(read)

    async def dlq_outbox_entries(self, limit: int = 500, now: int | None = None, skip: Iterable[str] = (),
                                 max_bytes: int = BATCH_PAYLOAD_BYTES) -> list[OutboxEntry]:
        """What `dlq_outbox` reads, for the publisher: each task's attempts left encoded. Decoding 5 attempts per
        task into objects and encoding them again was most of the outbox read's time (bench_kafka dlq). At most
        about `max_bytes` of payloads (one task at least): 500 large tasks at once held gigabytes."""
        params = self._outbox_params(limit, now, skip)

        def read(conn: sqlite3.Connection) -> list[OutboxEntry]:
            with contextlib.closing(conn.execute(q("dlq_outbox"), params)) as cursor:
                rows = within_bytes(iter_dict_rows(cursor), lambda row: len(row["payload"] or b""), max_bytes)
            attempts: dict[str, list[str]] = {}
            ids = {"ids": json.dumps([r["id"] for r in rows])}
            for task_id, body, late_result_of, note in conn.execute(q("attempts_json_of_many"), ids):
                if late_result_of is not None or note is not None:
                    body = _with_rare_fields(body, late_result_of, note)
                attempts.setdefault(task_id, []).append(body)
            return [OutboxEntry(Task.from_row(r, (), r["parked_behind"]), attempts.get(r["id"], [])) for r in rows]

        return await self.db.scan(read)

    def _outbox_params(self, limit: int, now: int | None, skip: Iterable[str]) -> dict[str, object]:
        return {"limit": limit, "now": 2**62 if now is None else now, "scoped": self.scoped,
                "skip": json.dumps(list(skip))}

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
        return await self.mark_dlq_published_many([(task, topic, partition, offset)], now, logged) == 1

    async def mark_dlq_published_many(self, marks: list[tuple[Task, str, int, int]], now: int,
                                      logged: bool = False) -> int:
        """Where the broker put each of a batch of DLQ records (task, topic, partition, offset), in one write: the
        acknowledgements of a batch arrive together. How many tasks were marked (one redriven meanwhile is not)."""
        params = [{"id": task.id, "topic": topic, "partition": partition, "offset": offset, "now": now,
                   "redrive_count": task.redrive_count, "logged": logged} for task, topic, partition, offset in marks]
        return await self.db.write(lambda c: c.executemany(q("mark_dlq_published"), params).rowcount)
