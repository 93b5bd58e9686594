"""ordering: key (SPEC §12) inside a lane: at most one record of a key runs at a time, in offset order; the others
of that key wait aside and come back to the front when it ends. A key whose record became a task is *blocked*:
its later records are parked (stored behind the task, not run). A key is unblocked only when the store says it
has no open task left, no task of it is on its way into the store, and none was reported since the store was
asked (`unblock` with the generation `blocked_keys` gave) — a key that looked free too early would run a record
ahead of its task.

Every method runs under the lane's lock (the lane's runners are threads); `ready` is the lane's deque.
"""

from __future__ import annotations

from collections import deque

from bridge.records import Fetched
from bridge.source.ends import Ran


class LaneKeys:
    def __init__(self) -> None:
        self.running: set[bytes] = set()
        self.waiting: dict[bytes, deque[Fetched]] = {}
        # blocked key → [generation (+1 at each task reported for it), tasks reported but not yet stored]
        self.blocked: dict[bytes, list[int]] = {}
        self.set_aside = 0  # records of a running key waiting aside

    def clear(self) -> None:
        self.waiting.clear()
        self.set_aside = 0

    def next_ready(self, ready: deque[Fetched]) -> tuple[Fetched, bool] | None:
        """`take` for one record (an async runner's): the record and whether it is to be parked."""
        chunk: deque[Fetched] = deque()
        parked: set[int] = set()
        self.take(ready, 1, chunk, parked)
        return (chunk[0], bool(parked)) if chunk else None

    def take(self, ready: deque[Fetched], n: int, chunk: deque[Fetched], parked: set[int]) -> int:
        """Up to n ready records into `chunk`, one a key, each key running from now; the offsets of those whose
        key is blocked (to be parked) into `parked`; records of a running key wait aside, in order. Their
        payload bytes.

        A key with a task on its way into the store (blocked, tasks pending) waits too: the store decides each
        record of a key in offset order. (Parked behind a head whose insert failed and is retried, a later record
        was stored PENDING and ran beside it; or it was stored first, and the retried earlier one then looked
        like a redelivery and was dropped.) Parks of a key are serialized as runs are."""
        running, blocked, waiting = self.running, self.blocked, self.waiting
        taken = 0
        while ready and n:
            record = ready.popleft()
            key = record.key()
            if key is not None:
                entry = blocked.get(key)
                if key in running or (entry is not None and entry[1] > 0):  # running, or a task on its way
                    waiting.setdefault(key, deque()).append(record)
                    self.set_aside += 1
                    continue
                running.add(key)
                if entry is not None:
                    parked.add(record.offset())
            chunk.append(record)
            taken += len(record)
            n -= 1
        return taken

    def load(self, keys: set[bytes]) -> None:
        for key in keys:
            self.blocked.setdefault(key, [0, 0])

    def block(self, key: bytes) -> None:
        self.blocked.setdefault(key, [0, 0])[0] += 1

    def blocked_keys(self) -> dict[bytes, int]:
        return {key: gen for key, (gen, pending) in self.blocked.items() if pending == 0}

    def unblock(self, free: dict[bytes, int]) -> None:
        for key, gen in free.items():
            entry = self.blocked.get(key)
            if entry is not None and entry[0] == gen and entry[1] == 0:
                del self.blocked[key]

    def stored(self, keys: list[bytes | None], ready: deque[Fetched]) -> bool:
        """Tasks reported for these keys are in the store now (or were put back to run again). True when a
        waiting record came back to the front."""
        back = False
        for key in keys:
            entry = self.blocked.get(key) if key is not None else None
            if key is None or entry is None or entry[1] == 0:
                continue
            entry[1] -= 1
            if entry[1] == 0 and key not in self.running:
                back = self.next_of(key, ready) or back
        return back

    def next_of(self, key: bytes, ready: deque[Fetched]) -> bool:
        """The key's next waiting record back to the front; False when none waits."""
        waiting = self.waiting.get(key)
        if not waiting:
            return False
        ready.appendleft(waiting.popleft())
        self.set_aside -= 1
        if not waiting:
            del self.waiting[key]
        return True

    def handed_back(self, record: Fetched) -> None:
        """A record taken and not started is back at the front of the lane: its key is not running (the key's
        records aside stay there, behind it)."""
        key = record.key()
        if key is not None:
            self.running.discard(key)

    def succeeded(self, ok: list[tuple[Fetched, float]], ready: deque[Fetched]) -> bool:
        """Records that succeeded (a chunk's, with their seconds): their keys are free, each key's next waiting
        record back to the front. True when one came back."""
        running, waiting = self.running, self.waiting
        back = False
        for record, _ in ok:
            key = record.key()
            if key is not None:
                running.discard(key)
                if waiting and key in waiting:
                    back = self.next_of(key, ready) or back
        return back

    def ended(self, ran: Ran, ready: deque[Fetched]) -> bool:
        """A record ended: its key is free to run its next record, blocked if the record became a task. True
        when a waiting record came back to the front."""
        key = ran.record.key
        if key is None:
            return False
        self.running.discard(key)
        if ran.task is not None:
            entry = self.blocked.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += 1
            return False  # its next record waits until this task is stored (`stored`)
        return self.next_of(key, ready)
