"""One state per assigned partition (source/partitions.py): its phase moves only forward, an illegal move is
refused loudly, and a later assignment of the same partition is a different object that an earlier one's
clean-up cannot touch."""

from __future__ import annotations

import pytest

from bridge.source.partitions import IllegalMove, Partitions, PartitionState, Phase

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
