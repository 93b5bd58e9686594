"""The first-delivery journal (SPEC §4.1): which records were running when the bridge stopped."""

from __future__ import annotations

import sqlite3

from bridge.store.database import Database
from bridge.store.queries import q


class Journal:
    db: Database  # the store's parts share its database and scope (Store.__init__)
    scoped: bool

    # ---- first-delivery journal -------------------------------------------------------------------------

    async def journal_inflight(self, run_id: str, ranges: list[tuple[str, int, int, int]],
                               committed: list[tuple[str, int, int]], now: int) -> None:
        """One transaction: this run's in-flight range per partition, and ranges now below the commit pruned. Not
        fsync'd unless it shares its group commit with a durable write: it is read after a crash of the process
        (a handler that killed it), which a commit written to the WAL survives; after a crash of the machine the
        records it names run again as first deliveries, not as suspects (the handler died with the machine)."""

        def apply(conn: sqlite3.Connection) -> None:
            for topic, partition, lo, hi in ranges:
                conn.execute(q("journal_inflight"), {"topic": topic, "partition": partition, "run_id": run_id,
                                                     "lo": lo, "hi": hi, "now": now})
            for topic, partition, offset in committed:
                conn.execute(q("journal_prune"), {"topic": topic, "partition": partition, "committed": offset})

        await self.db.write(apply, durable=False)

    async def journal_suspects(self, run_id: str) -> list[tuple[str, int, int, int]]:
        """Ranges written by earlier runs: their records were being handled when that run ended."""
        rows = await self.db.read(lambda c: c.execute(q("journal_suspects"), {"run_id": run_id}).fetchall())
        return [(r[0], r[1], r[2], r[3]) for r in rows]

    async def journal_forget_partitions(self, partitions: list[tuple[str, int]]) -> None:
        def apply(conn: sqlite3.Connection) -> None:
            for topic, partition in partitions:
                conn.execute(q("journal_forget_partition"), {"topic": topic, "partition": partition})

        await self.db.write(apply)

    async def journal_forget_run(self, run_id: str) -> None:
        await self.db.write(lambda c: c.execute(q("journal_forget_run"), {"run_id": run_id}))
