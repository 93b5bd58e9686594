"""The store's upkeep (SPEC §4.8): lapsed leases, queue timeouts, retention purges."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Mapping
from typing import Any

from bridge.model import LEASE_EXPIRED, ErrorInfo, Outcome, Status
from bridge.store.database import Database
from bridge.store.queries import q
from bridge.store.results import RunReport, attempt_params

log = logging.getLogger(__name__)


def purged(conn: sqlite3.Connection, rows: list[sqlite3.Row], scoped: bool) -> int:
    """The rest of a purge: the deleted tasks' history, and (scoped) a tombstone for their changelog."""
    for row in rows:
        conn.execute(q("delete_attempts"), {"id": row[0]})
        conn.execute(q("delete_redrives"), {"id": row[0]})
        if scoped and row[1] is not None:
            conn.execute(q("tombstone_add"), {"id": row[0], "home_topic": row[1], "home_partition": row[2]})
    return len(rows)


class Upkeep:
    db: Database  # the store's parts share its database and scope (Store.__init__)
    scoped: bool

    # ---- sweep (SPEC §4.8) -----------------------------------------------------------------------------

    async def lapsed_leases(self, now: int, limit: int = 500) -> list[sqlite3.Row]:
        params = {"now": now, "limit": limit, "scoped": self.scoped}
        return await self.db.read(lambda c: c.execute(q("lapsed_leases"), params).fetchall())

    async def expire_lease(self, lapsed: Mapping[str, Any] | sqlite3.Row, now: int, next_attempt_at: int | None,
                           error: ErrorInfo | None = None, holder_gone: bool = False) -> bool:
        """Reclaim one lease with a LEASE_EXPIRED attempt; DEAD when `next_attempt_at` is None.

        The sweep reclaims leases that lapsed; with `holder_gone` the lease is reclaimed before it lapses
        (the remote worker holding it disconnected: the fast path)."""
        error = error or ErrorInfo(LEASE_EXPIRED, f"lease held by {lapsed['lease_owner']} lapsed without a result")
        report = RunReport(lapsed["lease_started_at"] or now, now, Outcome.LEASE_EXPIRED, error,
                           lapsed["lease_owner"])
        base = {"id": lapsed["id"], "token": lapsed["lease_token"], "now": now, "any_time": int(holder_gone)}

        def apply(conn: sqlite3.Connection) -> bool:
            if next_attempt_at is None:
                params = {**base, "reason_type": error.type,
                          "reason_message": f"{error.message}; attempts exhausted"}
                changed = conn.execute(q("expire_lease_dead"), params).rowcount
            else:
                changed = conn.execute(q("expire_lease_reschedule"),
                                       {**base, "next_attempt_at": next_attempt_at}).rowcount
            if changed != 1:
                return False
            conn.execute(q("insert_attempt"), attempt_params(
                lapsed["id"], report, lapsed["attempt_count"], lapsed["redrive_count"]))
            return True

        return await self.db.write(apply)

    async def time_out(self, queue: str, cutoff: int, now: int, message: str, limit: int = 500) -> int:
        """PENDING or IN_FLIGHT tasks whose life began before `cutoff` → DEAD rdq.Timeout."""

        def apply(conn: sqlite3.Connection) -> int:
            rows = conn.execute(q("timed_out"), {"queue": queue, "cutoff": cutoff, "limit": limit,
                                                 "scoped": self.scoped}).fetchall()
            done = 0
            for row in rows:
                params = {"id": row["id"], "status": row["status"], "token": row["lease_token"], "now": now,
                          "cutoff": cutoff, "reason_message": message}
                if conn.execute(q("time_out_task"), params).rowcount != 1:
                    continue
                done += 1
                if row["status"] == Status.IN_FLIGHT:
                    # The running attempt loses its lease to the timeout: record it so history stays whole.
                    report = RunReport(row["lease_started_at"] or now, now, Outcome.LEASE_EXPIRED,
                                       ErrorInfo("rdq.Timeout", message), row["lease_owner"])
                    conn.execute(q("insert_attempt"), attempt_params(
                        row["id"], report, row["attempt_count"], row["redrive_count"]))
            return done

        return await self.db.write(apply)

    async def purge(self, queue: str, retain_from: str, cutoff: int, limit: int = 1000) -> int:
        query = "purge_fetched" if retain_from == "fetched" else "purge_finished"

        params = {"queue": queue, "cutoff": cutoff, "limit": limit, "scoped": self.scoped}
        return await self.db.write(lambda c: purged(c, c.execute(q(query), params).fetchall(), self.scoped))

    async def purge_task(self, task_id: str) -> bool:
        params = {"id": task_id, "scoped": self.scoped}
        return await self.db.write(lambda c: purged(c, c.execute(q("purge_task"), params).fetchall(), self.scoped) == 1)
