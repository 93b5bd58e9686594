"""Which offset of a partition may be committed: the highest contiguous done one (SPEC §5.1, §5.2).

Records of one partition run concurrently, so they finish out of order; the commit never passes a record that
is not done (succeeded, or its task durably stored).
"""

from __future__ import annotations

from collections import deque

_COMPACT_PAST = 4096  # offsets kept in fetch order beyond four times the pending ones before they are compacted


class PartitionTracker:
    """One partition's fetched records that are not done, and what may be committed.

    Asked for its lowest pending offset on every poll (the journal's range, the commit): kept in fetch order
    beside the set, so the answer is the first of that order still pending (done ones dropped from its front as
    they are met), not a scan of every pending offset. Records come in offset order within a partition; should
    they not (a seek), the tracker scans the set from then on — the answer is the same either way."""

    def __init__(self) -> None:
        self._pending: set[int] = set()  # fetched, not done: running or waiting for a slot
        self._order: deque[int] = deque()  # the pending offsets in fetch order (and done ones not yet dropped)
        self._in_order = True  # every offset was fetched after a lower one
        self._next_after_seen: int | None = None
        self._committed: int | None = None  # the last offset handed to store_offsets

    def fetched(self, offset: int) -> None:
        self.fetched_many([offset])

    def fetched_many(self, offsets: list[int]) -> None:
        """A poll's offsets of this partition, in fetch order (one set update, not a call a record)."""
        if not offsets:
            return
        if self._in_order:
            tail = self._order[-1] if self._order else -1
            if offsets[0] > tail and offsets == sorted(offsets):
                self._order.extend(offsets)
                if len(self._order) > _COMPACT_PAST + 4 * len(self._pending):
                    # Done offsets wait behind a pending one (a slow record): keep only the pending ones.
                    self._order = deque(sorted(self._pending.union(offsets)))
            else:
                self._in_order = False
                self._order.clear()
        self._pending.update(offsets)
        highest = max(offsets)
        if self._next_after_seen is None or highest >= self._next_after_seen:
            self._next_after_seen = highest + 1

    def done(self, offset: int) -> None:
        self._pending.discard(offset)

    def done_many(self, offsets: list[int]) -> None:
        self._pending.difference_update(offsets)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def lowest_pending(self) -> int | None:
        pending = self._pending
        if not pending:
            self._order.clear()
            return None
        if not self._in_order:
            return min(pending)
        order = self._order
        while order[0] not in pending:
            order.popleft()
        return order[0]

    def commit_offset(self) -> int | None:
        """The next offset to consume after everything done so far: what Kafka should store."""
        lowest = self.lowest_pending
        return self._next_after_seen if lowest is None else lowest
    def take_new_commit(self) -> int | None:
        """The commit offset if it moved since the last call, else None."""
        offset = self.commit_offset()
        if offset is None or offset == self._committed:
            return None
        self._committed = offset
        return offset

    def forget_commit(self) -> None:
        """The last commit offset did not reach Kafka: hand it out again."""
        self._committed = None
