"""Which offset of a partition may be committed: the highest contiguous done one (SPEC §5.1, §5.2).

Records of one partition run concurrently, so they finish out of order; the commit never passes a record that
is not done (succeeded, or its task durably stored).
"""

from __future__ import annotations


class PartitionTracker:
    def __init__(self) -> None:
        self._pending: set[int] = set()  # fetched, not done: running or waiting for a slot
        self._next_after_seen: int | None = None
        self._committed: int | None = None  # the last offset handed to store_offsets

    def fetched(self, offset: int) -> None:
        self._pending.add(offset)
        if self._next_after_seen is None or offset >= self._next_after_seen:
            self._next_after_seen = offset + 1

    def fetched_many(self, offsets: list[int]) -> None:
        """A poll's offsets of this partition, in fetch order (one set update, not a call a record)."""
        if not offsets:
            return
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
        return min(self._pending) if self._pending else None

    def commit_offset(self) -> int | None:
        """The next offset to consume after everything done so far: what Kafka should store."""
        if self._pending:
            return min(self._pending)
        return self._next_after_seen

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
