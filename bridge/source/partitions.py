"""One object per assigned source partition, with a phase whose moves are checked (as Kafka Streams'
`StoreChangelogReader` keeps a `ChangelogState` per changelog partition).

    assigned ─► restoring ─► active ─► leaving ─► gone
        └──────────────────────┘  (no changelog: nothing to restore)

`restoring`: its tasks are being read from the changelog; nothing of it runs. `active`: this instance owns it.
`leaving`: revoked; its running records finish and its tasks are handed over. `gone`: let go (revoked, lost); the
object is dropped. A partition lost and assigned again is a new object: what belonged to the old assignment (a
restore, a batch fetched before the loss) checks that its partition is still the same object.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from enum import StrEnum
from typing import Any

from bridge.records import TP
from bridge.source.lanes import Lane
from bridge.source.offsets import PartitionTracker


class Phase(StrEnum):
    ASSIGNED = "assigned"
    RESTORING = "restoring"
    ACTIVE = "active"
    LEAVING = "leaving"
    GONE = "gone"


_MOVES = {
    Phase.ASSIGNED: {Phase.RESTORING, Phase.ACTIVE, Phase.LEAVING, Phase.GONE},
    Phase.RESTORING: {Phase.ACTIVE, Phase.LEAVING, Phase.GONE},
    Phase.ACTIVE: {Phase.LEAVING, Phase.GONE},
    Phase.LEAVING: {Phase.GONE},
    Phase.GONE: set(),
}
HELD = frozenset({Phase.ASSIGNED, Phase.RESTORING, Phase.ACTIVE, Phase.LEAVING})  # assigned to this instance


class IllegalMove(RuntimeError):
    """A partition asked to move to a phase it cannot reach from where it is: a bug, said loudly."""


class PartitionState:
    """What this process holds of one assignment of one partition."""

    def __init__(self, tp: TP) -> None:
        self.tp = tp
        self.phase = Phase.ASSIGNED
        self.tracker = PartitionTracker()  # which of its offsets are done: what may be committed
        self.lane: Lane | None = None  # its fetched records (made when the first ones come)
        self.storing: set[asyncio.Task[None]] = set()  # its failures being stored
        self.baseline: int | None = None  # the committed offset found at assignment
        self.paused = False  # paused in librdkafka
        self.restored: dict[str, Any] = {}  # its restore's figures

    def move(self, to: Phase) -> None:
        if to not in _MOVES[self.phase]:
            raise IllegalMove(f"{self.tp[0]}/{self.tp[1]}: {self.phase} → {to}")
        self.phase = to

    def leave(self) -> None:
        """Gone, from wherever it is (a second way out — lost while leaving — changes nothing)."""
        if self.phase is not Phase.GONE:
            self.move(Phase.GONE)

    @property
    def owned(self) -> bool:
        """Its tasks are this instance's to run (restored; until it is gone)."""
        return self.phase in (Phase.ACTIVE, Phase.LEAVING)

    def commit_offset(self) -> int | None:
        offset = self.tracker.commit_offset()
        return self.baseline if offset is None else offset

    def __repr__(self) -> str:
        return f"PartitionState({self.tp[0]}/{self.tp[1]}, {self.phase})"


class Partitions:
    """The partitions assigned now. Replaced whole on every change, never changed in place: the consumer thread
    and the changelog writer's thread read it while the loop changes it."""

    def __init__(self) -> None:
        self._states: dict[TP, PartitionState] = {}

    def add(self, state: PartitionState) -> None:
        self._states = {**self._states, state.tp: state}

    def drop(self, state: PartitionState) -> bool:
        """Drop this state (not a later assignment's of the same partition). True if it was there."""
        if self._states.get(state.tp) is not state:
            return False
        self._states = {tp: s for tp, s in self._states.items() if s is not state}
        return True

    def get(self, tp: TP) -> PartitionState | None:
        return self._states.get(tp)

    def is_current(self, state: PartitionState) -> bool:
        return self._states.get(state.tp) is state

    def done(self, state: PartitionState | None, offset: int) -> None:
        """A record of `state`'s assignment is done (its task stored and logged). Not of a later assignment of the
        same partition: that one fetched the record anew, and it is done only once it ran again."""
        if state is not None and self.is_current(state):
            state.tracker.done(offset)

    def __iter__(self) -> Iterator[PartitionState]:
        return iter(list(self._states.values()))

    def __len__(self) -> int:
        return len(self._states)

    def of(self, tps: Iterable[TP]) -> list[PartitionState]:
        states = self._states
        return [s for tp in tps if (s := states.get(tp)) is not None]

    def tps(self, *phases: Phase) -> set[TP]:
        wanted = set(phases) or HELD
        return {tp for tp, s in self._states.items() if s.phase in wanted}

    def lanes(self) -> list[Lane]:
        return [s.lane for s in self._states.values() if s.lane is not None]
