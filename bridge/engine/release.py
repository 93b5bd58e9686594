"""The end of running attempts on a stop or a hand-over (SPEC §4.9, §10): they finish within the grace period,
then the leases still held are released, so their tasks run again at once rather than when the lease lapses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from bridge.clock import Clock
from bridge.engine.attempt import Execution
from bridge.store.database import StoreError
from bridge.store.tasks import Store

log = logging.getLogger(__name__)


async def finish_or_release(running: Callable[[], list[Execution]], grace: float, store: Store,
                            clock: Clock) -> int:
    """Wait up to `grace` for the attempts `running()` lists; release the leases of those still listed (shielded:
    a cancelled stop still releases). Returns how many leases were released."""
    pending = running()
    if pending:
        waits = [asyncio.ensure_future(e.done.wait()) for e in pending]
        await asyncio.wait(waits, timeout=grace)
        for w in waits:
            w.cancel()
    return await asyncio.shield(_release(running(), store, clock))


async def _release(executions: list[Execution], store: Store, clock: Clock) -> int:
    released = 0
    for execution in executions:
        if execution.ctx is not None:
            execution.ctx.lose_lease()
        if execution.running is not None:
            execution.running.abandon()
        try:
            if await store.release(execution.task.id, execution.task.lease_token, clock.now_ms()):
                released += 1
        except StoreError as e:
            log.error("could not release a lease (the sweep will reclaim it): %s", e,
                      extra={"task_id": execution.task.id})
    return released
