"""The in-flight journal of first deliveries (SPEC §4.1): before a batch's handlers start, each partition's
in-flight offset range is written to the store (one write per batch). If the process dies, those records come
back at the next start as suspects: they become tasks instead of running inline again — a handler that kills
the process is recognised on its return.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bridge.aio import Backoff
from bridge.clock import Clock
from bridge.records import TP
from bridge.store.database import StoreError
from bridge.store.tasks import Store

log = logging.getLogger(__name__)
Range = tuple[str, int, int, int]  # topic, partition, lowest pending offset, highest fetched offset


class InflightJournal:
    def __init__(self, store: Store, run_id: str, clock: Clock) -> None:
        self.store = store
        self.run_id = run_id
        self.clock = clock
        self._suspects: dict[TP, list[tuple[int, int]]] = {}
        self.suspects_seen = 0

    async def load(self) -> None:
        """The ranges a run of this instance left in flight: their records are suspects."""
        for topic, partition, lo, hi in await self.store.journal_suspects(self.run_id):
            self._suspects.setdefault((topic, partition), []).append((lo, hi))
        if self._suspects:
            log.warning("records in flight when the bridge last stopped will be handled as tasks: %s",
                        {f"{t}/{p}": r for (t, p), r in self._suspects.items()})

    def is_suspect(self, tp: TP, offset: int) -> bool:
        """Asked by a lane's runner for each record (on a handler thread for a sync handler)."""
        ranges = self._suspects.get(tp)
        if not ranges or not any(lo <= offset <= hi for lo, hi in ranges):
            return False
        self.suspects_seen += 1
        return True

    async def write(self, ranges: list[Range], committed: list[tuple[str, int, int]],
                    store_health: Callable[[bool], Any], while_failing: Callable[[], Awaitable[Any]]) -> None:
        """Durable before the batch starts; retried until it is (consumption paused meanwhile: `store_health`)."""
        backoff = Backoff(0.05, 5.0)
        while True:
            try:
                await self.store.journal_inflight(self.run_id, ranges, committed, self.clock.now_ms())
                store_health(True)
                return
            except StoreError as e:
                log.error("cannot journal in-flight records (retrying; consumption paused): %s", e)
                store_health(False)
                await while_failing()
                await backoff.sleep()

    async def prune(self, tps: set[TP]) -> None:
        """These partitions' rows (this run's and earlier runs') mark suspects only for this instance; the next
        owner starts from the committed offset without them. Kept, they would only grow."""
        try:
            await self.store.journal_forget_partitions(sorted(tps))
        except StoreError as e:
            log.warning("could not prune the journal of revoked partitions (retried at the next revoke): %s", e)

    def forget_suspects(self, tps: set[TP]) -> None:
        for tp in tps:
            self._suspects.pop(tp, None)

    async def forget_run(self) -> None:
        """Everything handed to a handler finished: this run's journal has nothing to say."""
        with contextlib.suppress(StoreError):
            await self.store.journal_forget_run(self.run_id)
