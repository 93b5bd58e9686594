"""An assignment's restore from the changelog (SPEC §10): every partition of it at once (one restore consumer),
each ready as soon as its own end is reached; the partitions whose restore failed retried together, with a backoff.
A restore belongs to one assignment (its partitions' state objects): lost meanwhile, it neither goes on nor
makes the partition ready."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaException, TopicPartition

from bridge.aio import Backoff, OneThread
from bridge.changelog.local import HomeState, LocalIndex
from bridge.changelog.restore import RestoreFailed, Restorer, RestoreReport
from bridge.changelog.writer import ChangelogWriter
from bridge.config import BridgeConfig
from bridge.records import TP
from bridge.source.backpressure import Backpressure
from bridge.source.keys import OrderKeys
from bridge.source.partitions import Partitions, PartitionState, Phase
from bridge.store.database import StoreError
from bridge.telemetry.core import Telemetry

log = logging.getLogger(__name__)


class Changelog:
    """What the consumer needs of the changelog: restore on assign, the writer for offsets, hand-over on revoke."""

    def __init__(self, local: LocalIndex, writer: ChangelogWriter, restorer: Restorer,
                 hand_over: Callable[[set[TP], float], Any], telemetry: Telemetry,
                 ensure_topics: Callable[[], Awaitable[dict[str, str]]] | None = None,
                 wake: Callable[[str], None] = lambda queue: None) -> None:
        self.ensure_topics = ensure_topics  # creates or checks the changelogs of sources that appeared since
        self.wake = wake  # a queue's claim loop looks again now (a restored partition's due tasks are claimable)
        self.local = local
        self.writer = writer
        self.restorer = restorer
        self.hand_over = hand_over
        self.telemetry = telemetry


class Restores:
    def __init__(self, config: BridgeConfig, partitions: Partitions, backpressure: Backpressure, keys: OrderKeys,
                 thread: OneThread, kafka: Callable[[], Consumer | None], changelog: Changelog | None) -> None:
        self.config = config
        self.partitions = partitions
        self.backpressure = backpressure
        self.keys = keys
        self.thread = thread
        self._kafka = kafka
        self.changelog = changelog
        self._tasks: set[asyncio.Task[None]] = set()

    async def changelog_status(self) -> dict[str, Any]:
        """Per owned partition: open tasks, changelog lag, restore state and figures; unreadable records."""
        if self.changelog is None:
            return {}
        local = self.changelog.local
        known = await local.partitions_status()
        partitions = {}
        for state in sorted(self.partitions, key=lambda s: s.tp):
            label = f"{state.tp[0]}/{state.tp[1]}"
            partitions[label] = {**known.get(label, {"open": 0, "changelog_lag": 0}),
                                 "restoring": state.phase is Phase.RESTORING, **state.restored}
        unreadable = await local.unreadable_counts()
        metrics = self.changelog.telemetry.metrics
        for name, n in unreadable.items():
            metrics.changelog_unreadable.labels(name).set(n)
        quarantined = await local.quarantined_counts()
        for name in unreadable:  # a quarantine that ended shows 0
            metrics.changelog_quarantined.labels(name).set(quarantined.get(name, 0))
        return {"partitions": partitions, "unreadable": unreadable, "quarantined": quarantined,
                "transactions": dict(self.changelog.writer.stats)}

    # ---- restore ---------------------------------------------------------------------------------

    def start(self, states: list[PartitionState], losing: list[concurrent.futures.Future[None]]) -> None:
        """Restore these partitions of an assignment (after the clean-up of a loss of theirs, if one runs)."""
        task = asyncio.create_task(self._restore_all(states, losing), name="rdq-restore")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _restoring_now(self, states: Sequence[PartitionState]) -> Callable[[TP], bool]:
        """Is this partition still restoring for the assignment these states are of?"""
        mine = {s.tp: s for s in states}
        return lambda tp: (s := mine.get(tp)) is not None and s.phase is Phase.RESTORING \
            and self.partitions.is_current(s)

    async def _restore_all(self, states: list[PartitionState], losing: Sequence[concurrent.futures.Future[None]],
                           ) -> None:
        """The assignment's partitions restore at once (one consumer); each is ready as soon as its own restore
        ends. Those that failed (the broker away, a changelog topic not there yet) are retried together, with a
        backoff. A partition lost and assigned again at once (a static member back within its session): its
        restore waits for the lost one's clean-up, which drops what this file held of it."""
        assert self.changelog is not None
        for future in losing:
            with contextlib.suppress(Exception):  # _lose logs its own failures
                await asyncio.wrap_future(future)
        tps = {s.tp for s in states}
        metrics = self.changelog.telemetry.metrics
        for tp in tps:
            metrics.restoring.labels(f"{tp[0]}/{tp[1]}").set(1)
        # The source offsets, asked once for the whole assignment while its changelogs are read.
        starts = asyncio.ensure_future(self._start_offsets(tps))
        current = self._restoring_now(states)
        failed = await self.changelog.restorer.restore_many(
            sorted(tps), current, functools.partial(self._restored_one, starts=starts, current=current))
        self._unrestored(failed, current)
        await self._retry(set(failed), current)
        await self._drop_strangers()

    @staticmethod
    def _unrestored(failed: dict[TP, Exception], current: Callable[[TP], bool]) -> None:
        for tp in sorted(failed):
            if current(tp):
                log.error("cannot restore %s/%d yet (it stays unready and unconsumed; retrying): %s", *tp, failed[tp])

    async def _retry(self, tps: set[TP], current: Callable[[TP], bool]) -> None:
        """The partitions whose restore failed, again together (one consumer; each ready as soon as its own end is
        read), with a backoff, until each succeeded or went: after an outage every one resumes when the broker
        is back, none waits behind another's retries."""
        assert self.changelog is not None
        restorer, backoff = self.changelog.restorer, Backoff(0.5, 10.0)
        while tps := {tp for tp in tps if current(tp)}:
            await backoff.sleep()
            if any(tp[0] not in restorer.topics for tp in tps) and self.changelog.ensure_topics is not None:
                with contextlib.suppress(Exception):  # the topic's check says why, in the next log line
                    await self.changelog.ensure_topics()
            try:
                failed = await restorer.restore_many(sorted(tps), current,
                                                     functools.partial(self._restored_one, current=current))
            except (RestoreFailed, KafkaException, StoreError) as e:
                failed = dict.fromkeys(tps, e)
            self._unrestored(failed, current)
            tps = set(failed)

    async def _restored_one(self, report: RestoreReport, current: Callable[[TP], bool],
                            starts: asyncio.Future[dict[TP, int | None]] | None = None) -> None:
        """A partition's tasks are in the store: its source offset known, its keys read, it runs. `starts`: the
        assignment's source offsets, being asked (else, or if that failed, asked for this partition now)."""
        assert self.changelog is not None
        tp = report.home
        if not current(tp):
            return  # revoked (or lost) while restoring
        known: dict[TP, int | None] = {}
        if starts is not None:
            with contextlib.suppress(KafkaException):
                known = await starts
        offset = known[tp] if tp in known else (await self._start_offsets({tp}))[tp]
        state = self.partitions.get(tp)
        if not current(tp) or state is None:
            return
        if offset is not None:
            state.baseline = offset
        await self.changelog.local.set_home(tp, HomeState.ACTIVE)
        if state.lane is not None and not state.lane.keys_loaded:
            await self.keys.load(state.lane)  # the restored tasks' keys: read now, not when the first records came
        if not current(tp):
            return
        state.move(Phase.ACTIVE)
        if (queue := self.config.queue_for_topic(tp[0])) is not None:
            self.changelog.wake(queue)  # its due tasks are in scope now: not left for the loop's next idle look
        self._report_restore(state, report)
        if report.unreadable:
            await self.changelog_status()  # the unreadable gauge, now
        self.backpressure.start(state)

    def _report_restore(self, state: PartitionState, report: RestoreReport) -> None:
        assert self.changelog is not None
        label = f"{state.tp[0]}/{state.tp[1]}"
        metrics = self.changelog.telemetry.metrics
        metrics.restoring.labels(label).set(0)
        metrics.restored_tasks.labels(label).set(report.tasks)
        metrics.restore_seconds.labels(label).set(report.seconds)
        state.restored = {"restored_tasks": report.tasks, "restore_seconds": round(report.seconds, 3),
                          "unreadable": report.unreadable}
        log.info("restored %s: %d tasks from %d changelog records in %.2fs (%d tombstones, %d unreadable, "
                 "%d local tasks the changelog no longer holds dropped)", label, report.tasks, report.records,
                 report.seconds, report.tombstones, report.unreadable, report.dropped)

    async def _start_offsets(self, tps: set[TP]) -> dict[TP, int | None]:
        """Each partition's committed offset, one request for them all. A partition with none (nothing consumed
        yet) still needs one in the changelog writer's transactions: its offsets are what fences a zombie's writes,
        and without any, a round holding an import or a redrive homed here was refused for ever. The offset the
        consumer would start from anyway (earliest, or latest when the config says so) is taken: it changes
        nothing of what is consumed. None: not known (the broker did not answer); its writes wait for a first
        record. Raises KafkaException when the committed offsets cannot be read."""
        consumer = self._kafka()
        assert consumer is not None
        committed = await self.thread.call(consumer.committed, [TopicPartition(*tp) for tp in sorted(tps)], 10.0)
        offsets: dict[TP, int | None] = {(p.topic, p.partition): p.offset for p in committed if p.offset >= 0}
        missing = sorted(tps - offsets.keys())
        if missing:
            policy = str(self.config.kafka.consumer.get("auto.offset.reset", "earliest"))
            # offsets_for_times with OFFSET_END / OFFSET_BEGINNING as the time: the latest / earliest offsets of
            # all of them in one ListOffsets request.
            start = OFFSET_END if policy in ("latest", "largest", "end") else OFFSET_BEGINNING
            try:
                found = await self.thread.call(consumer.offsets_for_times,
                                               [TopicPartition(*tp, start) for tp in missing], 10.0)
            except KafkaException as e:
                log.warning("%s: no committed offset and no watermarks (%s): their writes wait for a first record",
                            ", ".join(f"{t}/{p}" for t, p in missing), e)
                found = []
            for p in found:
                if p.error is None and p.offset >= 0:
                    offsets[(p.topic, p.partition)] = p.offset
        return {tp: offsets.get(tp) for tp in tps}

    async def _drop_strangers(self) -> None:
        """Tasks in this file whose partition is not this instance's (left by a crash, or by a run before the
        group moved it): the owner restores them from the changelog; kept here they would only mislead."""
        assert self.changelog is not None
        for home in await self.changelog.local.homes_present() - self.partitions.tps():
            if home[0] in self.changelog.restorer.topics:
                dropped = await self.changelog.local.drop_home(home)
                log.info("dropped %d tasks of %s/%d: another instance owns that partition", dropped, *home)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
