"""ordering: key (SPEC §12) on the consumer's side: which keys of a partition are blocked because the store holds
an open task of theirs. Read from the store when a partition's lane starts (after its restore), refreshed while it
runs (a key whose tasks all ended runs inline again), blocked ahead of a redrive."""

from __future__ import annotations

import asyncio
import logging

from bridge.aio import Backoff
from bridge.model import key_of_order_key, order_key_of, parse_order_key
from bridge.source.lanes import Lane
from bridge.source.partitions import Partitions
from bridge.store.database import StoreError
from bridge.store.tasks import Store

log = logging.getLogger(__name__)
_KEYS_INTERVAL = 0.2  # how often blocked keys are checked against the store (a freed key's next records are
# parked, then released by the store's trigger, until then: slower, never out of order)


class OrderKeys:
    def __init__(self, store: Store, partitions: Partitions) -> None:
        self.store = store
        self.partitions = partitions

    async def load(self, lane: Lane) -> None:
        """The partition's keys with an open task in the store block their records from the first one (tasks
        from before a restart, restored from the changelog, parked ones)."""
        backoff = Backoff(0.05, 5.0)
        while True:
            try:
                keys = await self.store.order_open_keys(lane.tp[0], lane.tp[1], lane.queue_name)
                break
            except StoreError as e:
                log.error("cannot read the open keys of %s/%d (retrying): %s", *lane.tp, e)
                await backoff.sleep()
        decoded = set()
        for order_key in keys:
            try:
                decoded.add(key_of_order_key(order_key))
            except ValueError as e:  # not made by this release: its task runs, later records of it are not held
                log.error("%s/%d: an ordering key that is not one: %s", *lane.tp, e)
        lane.load_keys(decoded)

    async def refresh(self) -> None:
        """Blocked keys whose tasks all ended are unblocked (their records run inline again)."""
        while True:
            await asyncio.sleep(_KEYS_INTERVAL)
            for lane in [lane for lane in self.partitions.lanes() if lane.ordered and not lane.released]:
                blocked = lane.blocked_keys()
                if not blocked:
                    continue
                by_order_key = {order_key_of(lane.tp[0], lane.tp[1], key): key for key in blocked}
                try:
                    still = await self.store.order_open_of(list(by_order_key))  # type: ignore[arg-type]
                except StoreError:
                    continue
                lane.unblock({key: blocked[key] for order_key, key in by_order_key.items() if order_key not in still})

    def block(self, order_keys: set[str]) -> None:
        """Tasks of these keys are about to be redriven: the lanes of their partitions park the keys' new records
        behind them (a record already running ends first)."""
        for order_key in order_keys:
            try:
                topic, partition, key = parse_order_key(order_key)
            except ValueError:
                continue
            state = self.partitions.get((topic, partition))
            if state is not None and state.lane is not None and state.lane.ordered:
                state.lane.block(key)
