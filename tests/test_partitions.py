"""One state per assigned partition (source/partitions.py): its phase moves only forward, an illegal move is
refused loudly, and a later assignment of the same partition is a different object that an earlier one's
clean-up cannot touch. Its offset tracker (source/offsets.py) commits only past records that are done; its polls
ask for as many records as the byte budget allows (source/consumer.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.live_config import LiveConfig
from bridge.source.backpressure import Backpressure
from bridge.source.consumer import next_poll_size
from bridge.source.offsets import PartitionTracker
from bridge.source.partitions import IllegalMove, Partitions, PartitionState, Phase
from bridge.store.tasks import Store
from tests.helpers import engine_config, eventually, failure

TP = ("in", 0)


def test_a_partition_moves_forward_through_its_phases() -> None:
    state = PartitionState(TP)
    assert state.phase is Phase.ASSIGNED and not state.owned
    state.move(Phase.RESTORING)
    assert not state.owned
    state.move(Phase.ACTIVE)
    assert state.owned
    state.move(Phase.LEAVING)
    assert state.owned  # its running records finish and its offsets are still committed while it leaves
    state.move(Phase.GONE)
    assert not state.owned


@pytest.mark.parametrize(("path", "illegal"), [
    ([Phase.RESTORING, Phase.ACTIVE], Phase.RESTORING),  # restored twice
    ([Phase.ACTIVE, Phase.LEAVING], Phase.ACTIVE),  # leaving, then running again
    ([Phase.RESTORING, Phase.LEAVING], Phase.LEAVING),  # released twice
    ([Phase.ACTIVE, Phase.GONE], Phase.ACTIVE),  # gone is the end
    ([], Phase.ASSIGNED),
])
def test_an_illegal_move_is_refused_and_changes_nothing(path: list[Phase], illegal: Phase) -> None:
    state = PartitionState(TP)
    for phase in path:
        state.move(phase)
    before = state.phase
    with pytest.raises(IllegalMove, match="in/0"):
        state.move(illegal)
    assert state.phase is before


def test_leaving_twice_is_one_departure() -> None:
    state = PartitionState(TP)
    state.move(Phase.ACTIVE)
    state.leave()
    state.leave()  # lost while it was being released: nothing more to do
    assert state.phase is Phase.GONE


def test_an_earlier_assignment_cannot_drop_a_later_one() -> None:
    partitions = Partitions()
    lost = PartitionState(TP)
    partitions.add(lost)
    again = PartitionState(TP)  # lost and assigned again at once: a new object
    partitions.drop(lost)
    partitions.add(again)
    assert not partitions.drop(lost)  # the lost one's late clean-up
    assert partitions.get(TP) is again and partitions.is_current(again) and not partitions.is_current(lost)


def test_a_record_done_for_a_lost_assignment_is_not_done_for_the_next_one() -> None:
    """A task's changelog wait may end after its partition was lost and assigned again (the CI run of 3a78cba lost
    records so): the new assignment fetched that record anew, and must not commit past it before it ran again."""
    partitions = Partitions()
    lost = PartitionState(TP)
    partitions.add(lost)
    lost.tracker.fetched(7)
    partitions.drop(lost)
    again = PartitionState(TP)
    partitions.add(again)
    again.tracker.fetched(7)
    partitions.done(lost, 7)  # the lost assignment's late callback
    assert again.commit_offset() != 8
    partitions.done(again, 7)
    assert again.commit_offset() == 8


def test_a_reader_iterating_the_partitions_is_not_disturbed_by_a_change() -> None:
    partitions = Partitions()
    states = [PartitionState(("in", p)) for p in range(3)]
    for state in states:
        partitions.add(state)
    seen = []
    for state in partitions:  # as the changelog writer's thread reads while the loop changes them
        seen.append(state)
        partitions.drop(states[2])
        partitions.add(PartitionState(("in", 9)))
    assert seen == states
    assert partitions.tps() == {("in", 0), ("in", 1), ("in", 9)}
    states[0].move(Phase.RESTORING)
    assert partitions.tps(Phase.RESTORING) == {("in", 0)}


class _OneAtATime:
    """The commit rule record by record (what the tracker's batch calls must agree with)."""

    def __init__(self) -> None:
        self.pending: set[int] = set()
        self.highest: int | None = None

    def commit_offset(self) -> int | None:
        if self.pending:
            return min(self.pending)
        return None if self.highest is None else self.highest + 1


@given(st.data())
def test_a_polls_offsets_tracked_together_commit_as_one_by_one_would(data: st.DataObject) -> None:
    """The poll loop hands a partition's offsets to its tracker a poll at a time (`fetched_many`) and a lane's
    finished records a batch at a time (`done_many`): the commit never passes a record not done, as the
    record-by-record model says (polls in any order: a rebalance may fetch an earlier offset again)."""
    tracker, model = PartitionTracker(), _OneAtATime()
    for _ in range(data.draw(st.integers(1, 20))):
        fetched = data.draw(st.lists(st.integers(0, 60), max_size=12))
        tracker.fetched_many(fetched)
        model.pending.update(fetched)
        if fetched:
            model.highest = max(fetched if model.highest is None else [*fetched, model.highest])
        done = data.draw(st.lists(st.sampled_from(sorted(model.pending)), unique=True)) if model.pending else []
        tracker.done_many(done)
        model.pending.difference_update(done)
        assert tracker.commit_offset() == model.commit_offset()
        assert tracker.pending == len(model.pending)


def test_a_slow_record_does_not_keep_every_offset_done_behind_it() -> None:
    """The tracker keeps its pending offsets in fetch order to find the lowest without a scan; while one record
    runs long, the thousands done behind it are dropped from that order, not kept until it ends."""
    tracker = PartitionTracker()
    tracker.fetched_many([0])
    for start in range(1, 200_001, 500):
        batch = list(range(start, start + 500))
        tracker.fetched_many(batch)
        tracker.done_many(batch)
        assert tracker.commit_offset() == 0
    assert len(tracker._order) < 10_000
    tracker.done(0)
    assert tracker.commit_offset() == 200_001 and tracker.pending == 0


def test_polls_grow_to_five_hundred_small_records_and_stay_within_the_byte_budget() -> None:
    """A poll asks for four times the last, up to 500 records (a poll's in-flight range is what a crash turns into
    suspects: larger polls dead-lettered records under poison pills); large records are asked for fewer at a
    time, a quarter of the backlog's budget (half of kafka.max_buffered_mb) a poll at most."""
    sizes, size = [], 4
    for _ in range(5):
        size = next_poll_size(size, 1024, 64.0)
        sizes.append(size)
    assert sizes == [16, 64, 256, 500, 500]
    assert next_poll_size(500, 100_000, 64.0) == 83  # 32 MiB / 4 / 100 kB
    assert next_poll_size(500, 900_000, 8.0) == 1  # never none
    assert next_poll_size(1, 0, 64.0) == 4  # empty values count as one byte


async def test_a_queue_is_counted_for_backpressure_only_while_one_of_its_partitions_serves(tmp_path: Path) -> None:
    """The count decides pauses of the queue's consumed partitions only: none while they all restore (a restore of a
    million tasks counted 100,000 of them four times a second for nothing). A queue held at its limit stays held
    until one serves; then the count runs and lets it go once drained."""
    config = engine_config(str(tmp_path / "rdq.db"), q={"handler": "ok", "sources": ["in"], "max_open_tasks": 2})
    store = await Store.open(tmp_path / "rdq.db")
    counted: list[str] = []
    real = store.count_open

    async def count_open(queue: str, most: int = -1) -> int:
        counted.append(queue)
        return await real(queue, most)

    store.count_open = count_open  # type: ignore[method-assign]
    partitions = Partitions()
    state = PartitionState(TP)
    state.move(Phase.RESTORING)
    partitions.add(state)
    backpressure = Backpressure(config, LiveConfig(config), store, partitions)
    await store.submit_many([failure(), failure(), failure()])
    stop = asyncio.Event()
    watching = asyncio.create_task(backpressure.watch(stop))
    try:
        await asyncio.sleep(0.8)  # three intervals of the watch
        assert counted == [] and backpressure.held_queues() == set()
        state.move(Phase.ACTIVE)
        assert await eventually(lambda: backpressure.held_queues() == {"q"}, within=5)
        assert counted and set(counted) == {"q"}
        state.move(Phase.LEAVING)  # not served any more: the hold stays, nothing is counted
        await asyncio.sleep(0.3)
        before = len(counted)
        await store.db.write(lambda conn: conn.execute("DELETE FROM tasks"))
        await asyncio.sleep(0.8)
        assert len(counted) == before and backpressure.held_queues() == {"q"}
        served = PartitionState(("in", 1))
        served.move(Phase.ACTIVE)
        partitions.add(served)
        assert await eventually(lambda: backpressure.held_queues() == set(), within=5)
    finally:
        stop.set()
        await watching
        await store.close()
