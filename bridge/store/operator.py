"""What an operator or an admin command changes (SPEC §7): redrives, pauses and policies, purges of a
queue, a DEAD task re-created from a DLQ record, and the admin commands already seen."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from bridge.model import Status, Task, headers_json, home_params
from bridge.store.database import Database
from bridge.store.queries import q
from bridge.store.results import Redriven
from bridge.store.upkeep import purged

AUDIT_ARGS_MAX = 2000  # characters of a command's arguments kept in the audit


def audit_args(args: dict[str, Any] | None) -> str | None:
    if args is None:
        return None
    text = json.dumps(args, sort_keys=True, default=str)
    return text if len(text) <= AUDIT_ARGS_MAX else text[: AUDIT_ARGS_MAX - 1] + "…"


class OperatorActions:
    db: Database  # the store's parts share its database and scope (Store.__init__)
    scoped: bool

    # ---- operator actions ------------------------------------------------------------------------------

    async def redrive(self, task_id: str, now: int, by: str | None = None, request_id: str | None = None,
                      key_id: str | None = None, max_redrives: int | None = None) -> bool:
        """DEAD → PENDING due now, attempt_count 0, redrive_count + 1, history kept, audited (SPEC §7.3): who
        said they did it (`by`, self-asserted) and which verified key signed the command (`key_id`). With
        `max_redrives`, a task redriven that many times already stays DEAD (the loop guard)."""
        return bool(await self.redrive_many([task_id], now, by, request_id, key_id, max_redrives))

    async def redrive_many(self, ids: list[str], now: int, by: str | None = None, request_id: str | None = None,
                           key_id: str | None = None, max_redrives: int | None = None) -> list[Redriven]:
        """`redrive` of each task of `ids` in one transaction (one commit for a batch of a bulk redrive); returns
        those redriven, with what their redrive span needs."""

        def apply(conn: sqlite3.Connection) -> list[Redriven]:
            done = []
            for task_id in ids:
                got = conn.execute(q("redrive"), {"id": task_id, "now": now, "scoped": self.scoped,
                                                  "max_redrives": max_redrives}).fetchone()
                if got is None:
                    continue
                conn.execute(q("insert_redrive"), {"task_id": task_id, "redrive_no": got[0], "at": now, "by": by,
                                                   "request_id": request_id, "key_id": key_id})
                done.append(Redriven(task_id, got[1], json.loads(got[2])))
            return done

        return await self.db.write(apply)

    async def redrive_outcomes(self, request_id: str) -> dict[str, int]:
        """Where the tasks a redrive request moved are now: succeeded, failed (DEAD again, or an attempt since the
        redrive failed), waiting (not run yet or running its first attempt), gone (purged)."""
        rows = await self.db.scan(lambda c: c.execute(q("redrive_outcomes"), {"request_id": request_id}).fetchall())
        out = {"succeeded": 0, "failed": 0, "waiting": 0, "gone": 0}
        for status, tried, n in rows:
            if status is None:
                out["gone"] += n
            elif status == Status.SUCCEEDED.value:
                out["succeeded"] += n
            elif status == Status.DEAD.value or tried:
                out["failed"] += n
            else:
                out["waiting"] += n
        return out
    # ---- admin (SPEC §7) -------------------------------------------------------------------------------

    async def admin_seen(self, request_id: str, command: str, issued_by: str | None, now: int,
                         key_id: str | None = None, args: dict[str, Any] | None = None) -> bool:
        """Remember a verified request id (the audit of every command: what, who said, which key, its arguments).
        False when it was seen before: a replay."""
        params = {"request_id": request_id, "command": command, "issued_by": issued_by, "now": now,
                  "key_id": key_id, "args": audit_args(args)}
        return await self.db.write(lambda c: c.execute(q("admin_request_seen"), params).rowcount == 1)

    async def admin_prune(self, before: int, audit_before: int) -> None:
        params = {"before": before, "audit_before": min(before, audit_before)}
        await self.db.write(lambda c: c.execute(q("admin_requests_prune"), params))

    async def admin_audit(self, since: int | None, limit: int, reads: bool) -> list[dict[str, Any]]:
        params = {"since": since, "limit": limit, "reads": int(reads)}
        rows = await self.db.read(lambda c: c.execute(q("admin_requests_recent"), params).fetchall())
        return [dict(r) for r in rows]

    async def queue_settings(self) -> dict[str, tuple[dict[str, Any] | None, bool]]:
        rows = await self.db.read(lambda c: c.execute(q("queue_settings_all")).fetchall())
        return {r["queue"]: (json.loads(r["policy"]) if r["policy"] else None, bool(r["paused"])) for r in rows}

    async def set_paused(self, queue: str, paused: bool, by: str | None, now: int, key_id: str | None = None) -> None:
        params = {"queue": queue, "paused": int(paused), "by": by, "now": now, "key_id": key_id}
        await self.db.write(lambda c: c.execute(q("queue_set_paused"), params))

    async def set_policy(self, queue: str, policy: dict[str, Any] | None, by: str | None, now: int,
                         key_id: str | None = None) -> None:
        params = {"queue": queue, "policy": json.dumps(policy) if policy else None, "by": by, "now": now,
                  "key_id": key_id}
        await self.db.write(lambda c: c.execute(q("queue_set_policy"), params))

    async def purge_queue(self, queue: str, status: Status | None = None, before: int | None = None,
                          limit: int = 10_000) -> int:
        params = {"queue": queue, "status": status.value if status else None, "before": before, "limit": limit,
                  "scoped": self.scoped}
        return await self.db.write(lambda c: purged(c, c.execute(q("purge_terminal"), params).fetchall(), self.scoped))

    async def recreate_dead(self, task: Task, topic: str, partition: int, offset: int, now: int,
                            home: tuple[str, int] | None = None) -> bool:
        """Put back a DEAD task from its DLQ envelope, same id and history, at `now` (its retention counts from
        then, not from its death). False if the store has it. `home`: the partition it goes home to (default: its
        `rdq.source` partition)."""

        def apply(conn: sqlite3.Connection) -> bool:
            if conn.execute(q("get_task"), {"id": task.id}).fetchone() is not None:
                return False
            reason = task.dead_reason
            conn.execute(q("insert_task_copy"), {
                "id": task.id, "queue": task.queue, "handler_ref": task.handler_ref,
                "handler_version": task.handler_version, "payload": task.payload,
                "payload_content_type": task.payload_content_type,
                "headers": headers_json(task.headers), "attempt_count": task.attempt_count,
                "redrive_count": task.redrive_count, "created_at": task.created_at,
                "finished_at": task.finished_at or task.created_at, "now": now,
                "dead_reason_type": reason.type if reason else "rdq.Unknown",
                "dead_reason_message": reason.message if reason else "", "dlq_topic": topic,
                "dlq_partition": partition, "dlq_offset": offset, **home_params(home or task.home),
                "order_key": task.order_key, "order_seq": task.order_seq,
            })  # fmt: skip
            for seq, attempt in enumerate(task.attempts, start=1):
                conn.execute(q("insert_attempt_copy"), {**attempt.params(task.id), "seq": seq})
            return True

        return await self.db.write(apply)
