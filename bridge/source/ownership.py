"""Which source partitions are this instance's (SPEC §4.10, §10): serving a rebalance, restoring an assignment
from the changelog, handing revoked partitions over, forgetting lost ones.

The rebalance callbacks run on the consumer's thread (inside consume); everything else here runs on the loop.
A partition's state changes only on the loop (Partitions is replaced whole), except its phase, which a loss
moves at once on the consumer thread so that nothing of a lost partition goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from bridge.aio import OneThread
from bridge.changelog.local import HomeState
from bridge.config import BridgeConfig
from bridge.records import TP
from bridge.source.backpressure import Backpressure
from bridge.source.journal import InflightJournal
from bridge.source.keys import OrderKeys
from bridge.source.partitions import Partitions, PartitionState, Phase
from bridge.source.restores import Changelog, Restores
from bridge.store.database import StoreError

log = logging.getLogger(__name__)
_FLUSH_TIMEOUT = 15.0  # a revoke's last changelog transaction (the writer's own timeouts are shorter)


def offsets_to_commit(states: Sequence[PartitionState], only_new: bool = True) -> list[TopicPartition]:
    out = []
    for state in states:
        offset = state.tracker.take_new_commit() if only_new else state.tracker.commit_offset()
        if offset is not None:
            out.append(TopicPartition(state.tp[0], state.tp[1], offset))
    return out


class Ownership:
    def __init__(self, config: BridgeConfig, partitions: Partitions, backpressure: Backpressure, keys: OrderKeys,
                 journal: InflightJournal, thread: OneThread, kafka: Callable[[], Consumer | None],
                 grace_period: float, changelog: Changelog | None = None) -> None:
        self.config = config
        self.partitions = partitions
        self.backpressure = backpressure
        self.keys = keys
        self.journal = journal
        self.thread = thread
        self._kafka = kafka
        self.grace_period = grace_period
        self.changelog = changelog
        self._loop: asyncio.AbstractEventLoop | None = None
        self.restores = Restores(config, partitions, backpressure, keys, thread, kafka, changelog)
        # A lost partition's store clean-up under way: assigned again meanwhile, its restore waits for it.
        self._losing: dict[TP, concurrent.futures.Future[None]] = {}
        # Both replaced whole on the consumer thread (rebalance callbacks), read by the changelog writer's thread.
        self._metadata: Any | None = None
        self._writable: frozenset[TP] = frozenset()
        # The latest state made for each partition, on the consumer thread (and read there only): a loss right
        # after an assignment finds the new state even before the loop has added it to `partitions`.
        self._latest: dict[TP, PartitionState] = {}
        # The group gave this member its first assignment (none is one: an idle member of a group with more
        # members than partitions). Set on the loop with the assigned states, so whoever reads it (`/readyz`)
        # finds them there, restoring. Not unset by later rebalances: readiness does not flap with the group.
        self.joined = not config.source_topics()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # ---- what is this instance's ----------------------------------------------------------------------------

    def owns(self, topic: str, partition: int) -> bool:
        """Is this source partition assigned to this instance now (and restored)?"""
        state = self.partitions.get((topic, partition))
        return state is not None and state.owned

    def group_metadata(self) -> Any | None:
        """The group metadata of the generation that gave this instance its partitions (taken in the rebalance
        callbacks, not live): once the member is fenced and rejoins, the live one would be valid again while
        this instance has not yet let go of what it lost — and the coordinator checks generations, not which
        member owns a partition. None after a loss, until the next assignment."""
        return self._metadata

    def writable(self) -> frozenset[TP]:
        """The partitions whose tasks and offsets this instance may write now (set on the consumer thread)."""
        return self._writable

    def commit_positions(self) -> dict[TP, int]:
        """What the changelog writer commits for each owned partition: the highest contiguous done offset."""
        writable = self._writable
        out = {}
        for state in self.partitions:
            if state.owned and state.tp in writable and (offset := state.commit_offset()) is not None:
                out[state.tp] = offset
        return out

    # ---- rebalances (called on the consumer thread, inside consume) -----------------------------------------

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        assert self._loop is not None
        self._metadata = consumer.consumer_group_metadata()  # every rebalance is a new generation
        self._writable = self._writable | tps
        states = [PartitionState(tp) for tp in sorted(tps)]
        for state in states:
            self._latest[state.tp] = state
            # Set here, on the consumer thread: the states join `partitions` on the loop before the records this
            # consume returns are handled, and no record of a restoring partition starts.
            state.move(Phase.RESTORING if self.changelog is not None else Phase.ACTIVE)
        self._loop.call_soon_threadsafe(self._add, states)
        if self.changelog is not None:
            losing = [f for tp in tps if (f := self._losing.get(tp)) is not None and not f.done()]
            self._loop.call_soon_threadsafe(self.restores.start, states, losing)
        log.info("assigned %s", sorted(f"{t}/{p}" for t, p in tps))

    def _add(self, states: list[PartitionState]) -> None:
        for state in states:
            if state.phase is not Phase.GONE:  # lost again before this ran
                self.partitions.add(state)
        self.joined = True

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        assert self._loop is not None
        self._metadata = consumer.consumer_group_metadata()  # the generation that revokes them: still ours
        future = asyncio.run_coroutine_threadsafe(self.release(tps), self._loop)
        try:
            offsets = future.result(self.grace_period + _FLUSH_TIMEOUT + 5)
        except Exception:
            log.exception("could not drain revoked partitions; their uncommitted records will be redelivered")
            return
        finally:
            self._writable = self._writable - tps
        if offsets and self.changelog is None:
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as e:
                log.warning("commit on revoke failed (records will be redelivered): %s", e)
        log.info("revoked %s", sorted(f"{t}/{p}" for t, p in tps))

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        assert self._loop is not None
        # At once, on this thread: the writer must not write a lost partition's tasks or offsets, not even in a
        # round already under way (it filters with these at produce time), before _lose has dropped them.
        self._writable = self._writable - tps
        self._metadata = None
        # Here too: gone before an assignment of the same partitions that may follow at once (a static member
        # back within its session) — that one is a new state; a restore or a batch of this one stops.
        states = [s for tp in sorted(tps) if (s := self._latest.get(tp)) is not None]
        for state in states:
            state.leave()
        self._loop.call_soon_threadsafe(self._forget_states, states)
        future = asyncio.run_coroutine_threadsafe(self._lose(tps), self._loop)
        for tp in tps:
            self._losing[tp] = future
        log.warning("partitions lost %s: their uncommitted records will be redelivered", sorted(tps))

    # ---- hand-over (revoke), loss -------------------------------------------------------------------------

    async def release(self, tps: set[TP]) -> list[TopicPartition]:
        """Finish the revoked partitions' running records (within the grace period) and say what to commit.

        Records not started are dropped here: they stay uncommitted, so the next owner gets them.
        """
        # Not one already leaving or gone: after a stop's own hand-over, the revoke inside close() has nothing left
        states = [s for s in self.partitions.of(tps) if s.phase in (Phase.RESTORING, Phase.ACTIVE)]
        if not states:
            return []
        for state in states:
            if state.lane is not None:
                state.lane.let_go()  # records not started stay uncommitted: the next owner gets them
        restoring = {s.tp for s in states if s.phase is Phase.RESTORING}
        for state in states:
            state.move(Phase.LEAVING)
        owned = {s.tp for s in states} - restoring
        if self.changelog is not None:
            for tp in owned:
                await _logged_call(self.changelog.local.set_home(tp, HomeState.LEAVING))
        began = time.monotonic()
        late = await self.drain(states, self.grace_period)
        if late:
            log.warning("%d records still running after the grace period; they may run twice", late)
        if self.changelog is not None:
            # One grace period for the first deliveries and the retries together.
            await self._hand_over(owned, max(0.0, self.grace_period - (time.monotonic() - began)))
            for tp in restoring:  # what a restore cut short put in this file: the changelog has it all
                await _logged_call(self.changelog.local.drop_home(tp))
        offsets = offsets_to_commit(states, only_new=False)
        await self._forget(states)
        return offsets

    async def drain(self, states: Sequence[PartitionState], within: float) -> int:
        """Wait (up to `within` seconds) for these partitions' running records and the storing of their
        failures. Returns how many records were still running."""
        lanes = [s.lane for s in states if s.lane is not None]
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            storing = [t for s in states for t in s.storing]
            if not any(lane.busy for lane in lanes) and not storing:
                return 0
            await asyncio.sleep(0.01)
        storing = [t for s in states for t in s.storing]
        if storing:  # stores retry until durable: a record whose handler ended is never given up here
            await asyncio.wait(storing, timeout=5.0)
        return sum(lane.running() for lane in lanes)

    async def serve_rebalance_until_flushed(self, tries: int = 10) -> None:
        """A stop that lands in a rebalance (another instance just left): the group moved to a new generation
        this instance has not joined, so its transactions are refused as stale. Take part in the rebalance (its
        callbacks hand over what moves and refresh the generation) without handling what it fetches — those
        records stay uncommitted for their next owner — until a flush commits."""
        consumer = self._kafka()
        assert self.changelog is not None and consumer is not None
        for _ in range(tries):
            if not len(self.partitions) or await self.changelog.writer.flush():
                return
            log.info("stopping during a rebalance: joining it before the last changelog flush")
            await self.thread.call(consumer.consume, 100, 0.5)  # rebalance callbacks run in here

    async def _hand_over(self, tps: set[TP], grace: float) -> None:
        """Revoked partitions' tasks: running attempts finish (or are released), the changelog is flushed with
        the final offsets, then this file lets the tasks go: the next owner restores them."""
        assert self.changelog is not None
        began = time.monotonic()
        await self.changelog.hand_over(tps, grace)
        handed = time.monotonic()
        flushed = await self.changelog.writer.flush()
        log.info("hand-over of %s: running attempts %.2fs, changelog flush %.2fs (%s)",
                 sorted(f"{t}/{p}" for t, p in tps), handed - began, time.monotonic() - handed,
                 "committed" if flushed else "NOT committed")
        for tp in tps:
            if flushed:
                dropped = await _logged_call(self.changelog.local.drop_home(tp))
                log.info("handed over %s/%d: %s tasks flushed to the changelog and dropped here", *tp, dropped)
            else:
                # Kept (not acted on): the next start's restore sorts it out; the changelog stays the truth.
                await _logged_call(self.changelog.local.set_home(tp, HomeState.NOT_OURS))
                log.warning("handed over %s/%d without a final changelog flush: transitions since the last "
                            "transaction are lost to the next owner (their attempts run again)", *tp)

    async def _lose(self, tps: set[TP]) -> None:
        """Partitions lost (this instance was out of the group): another owns them already; whatever this file
        holds of theirs that the changelog does not is lost to it (those attempts run again there). What this
        process knew of them is forgotten already (`_forget_states`, scheduled by `on_lost`)."""
        try:
            if self.changelog is not None:
                for tp in tps:
                    await _logged_call(self.changelog.local.set_home(tp, HomeState.NOT_OURS))
                await self.changelog.hand_over(tps, 0.0)
                for tp in tps:
                    await _logged_call(self.changelog.local.drop_home(tp))
            # Not the journal of a partition assigned again meanwhile: its new records may be journaled already
            # (the rows of the lost assignment stay with them: suspects at worst, pruned at the next revoke).
            await self.journal.prune(tps - self.partitions.tps())
        finally:
            for tp in tps:
                if (future := self._losing.get(tp)) is not None and future.done():
                    del self._losing[tp]

    async def _forget(self, states: list[PartitionState]) -> None:
        self._forget_states(states)
        await self.journal.prune({s.tp for s in states})

    def _forget_states(self, states: list[PartitionState]) -> None:
        """What this process holds of these partitions' assignments, in memory: dropped (their records not
        started stay uncommitted for the next owner). A later assignment of the same partition is not touched."""
        for state in states:
            state.leave()
            if state.lane is not None:
                state.lane.let_go()
            if self.partitions.drop(state):
                self.journal.forget_suspects({state.tp})


async def _logged_call(call: Any) -> Any:
    try:
        return await call
    except StoreError as e:
        log.error("store error while handing over a partition: %s", e)
        return None
