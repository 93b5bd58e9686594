"""Per-key ordering under random interleavings (SPEC §12), property-based, on a real SQLite store: records of a few
keys arrive (run inline when their key is free, parked when it is not, as a lane does), tasks are claimed and
succeed, fail or die, heads are skipped or redriven, and the bridge "crashes" (the store closed and opened again,
leases lost, what was running run again). After every step: never two tasks of a key running or due at once; a
task runs only when it is the earliest unfinished record of its key; no parked task is left without a head that
will release it."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from bridge.model import ErrorInfo, NewTask, Outcome, Status, Task, order_key_of
from bridge.store import RunReport, Store

KEYS = [b"a", b"b", b"c"]
LEASE = 1.0


class Ordering(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="rdq-ordering-"))
        self.store: Store = self.run(Store.open(self.dir / "rdq.db", synchronous="NORMAL"))
        self.now = 1_000_000
        self.offset = 0
        self.ids: list[str] = []
        self.hold = {KEYS[0]: False, KEYS[1]: True, KEYS[2]: False}  # on_dead per key (two queues' worth)
        self.finished_inline: dict[bytes, list[int]] = {k: [] for k in KEYS}
        self.ran: list[tuple[bytes, int]] = []  # every handler run (inline or claimed), in order

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def tick(self) -> int:
        self.now += 10
        return self.now

    def tasks(self) -> list[Task]:
        return [t for t in (self.run(self.store.get(i)) for i in self.ids) if t is not None]

    def of_key(self, key: bytes) -> list[Task]:
        return [t for t in self.tasks() if t.order_key == order_key_of("t", 0, key)]

    def blocked(self, key: bytes) -> bool:
        return bool(self.run(self.store.order_open_of([order_key_of("t", 0, key)])))  # type: ignore[list-item]

    def _new(self, key: bytes, status: Status, dead: bool = False) -> NewTask:
        now = self.tick()
        return NewTask(queue="q", handler_ref="h", payload=b"{}",
                       headers={"rdq.source": f"kafka://t/0/{self.offset}"},
                       status=status, created_at=now, first_attempt=None,
                       next_attempt_at=now if status == Status.PENDING else None,
                       dead_reason=ErrorInfo("Boom", "permanent") if dead else None,
                       order_key=order_key_of("t", 0, key), order_seq=self.offset, order_hold=self.hold[key])

    def check_runnable(self, key: bytes, seq: int) -> None:
        """A record of `key` runs: nothing of its key runs or is due beside it, nothing earlier waits parked."""
        self.ran.append((key, seq))
        for task in self.of_key(key):
            if task.order_seq == seq:
                continue
            assert not (task.status in (Status.PENDING, Status.IN_FLIGHT) and task.order_seq is not None
                        and task.order_seq != seq), f"{key!r}/{seq} runs beside {task.order_seq} ({task.status})"
            # A redriven head of a key that had moved on (on_dead: release) waits parked at the front: it is next,
            # not before the record already running or due.
            if task.status == Status.PARKED and task.redrive_count == 0:
                assert task.order_seq is not None and task.order_seq > seq, \
                    f"{key!r}/{seq} runs before the earlier parked {task.order_seq}"

    # ---- the lane's side: a record arrives --------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS), fails=st.sampled_from(["no", "retry", "dead"]))
    def arrive(self, key: bytes, fails: str) -> None:
        self.offset += 1
        if self.blocked(key):
            self.ids.append(self.run(self.store.submit(self._new(key, Status.PARKED))))
            return
        self.check_runnable(key, self.offset)
        if fails == "no":
            self.finished_inline[key].append(self.offset)
        else:
            status = Status.DEAD if fails == "dead" else Status.PENDING
            self.ids.append(self.run(self.store.submit(self._new(key, status, dead=fails == "dead"))))

    # ---- the scheduler's side ---------------------------------------------------------------------------

    @rule(outcome=st.sampled_from([Outcome.SUCCESS, Outcome.RETRYABLE_FAILURE, Outcome.PERMANENT_FAILURE]))
    def claim_and_end(self, outcome: Outcome) -> None:
        for task in self.run(self.store.claim_due("q", 10, LEASE, "w", self.tick())):
            key = next(k for k in KEYS if task.order_key == order_key_of("t", 0, k))
            assert task.order_seq is not None
            self.check_runnable(key, task.order_seq)
            now = self.tick()
            report = RunReport(now, now, outcome, None if outcome == Outcome.SUCCESS else ErrorInfo("Boom", "x"),
                               "w")
            if outcome == Outcome.SUCCESS:
                self.run(self.store.record_success(task.id, task.lease_token, task.attempt_count, report))
            elif outcome == Outcome.RETRYABLE_FAILURE:
                self.run(self.store.record_retry(task.id, task.lease_token, report, now))
            else:
                self.run(self.store.record_dead(task.id, task.lease_token, report, ErrorInfo("Boom", "x")))

    @rule(key=st.sampled_from(KEYS))
    def skip_head(self, key: bytes) -> None:
        for task in self.of_key(key):
            self.run(self.store.skip(task.id))

    @rule(key=st.sampled_from(KEYS))
    def redrive_dead(self, key: bytes) -> None:
        dead = [t for t in self.of_key(key) if t.status == Status.DEAD]
        if dead:
            self.run(self.store.redrive(dead[0].id, self.tick()))

    @rule()
    def crash(self) -> None:
        """The bridge dies: the store is closed and opened again; leases held are lost (reclaimed at once)."""
        self.run(self.store.close())
        self.store = self.run(Store.open(self.dir / "rdq.db", synchronous="NORMAL"))
        self.now += int(LEASE * 1000) + 1
        for row in self.run(self.store.lapsed_leases(self.now)):
            self.run(self.store.expire_lease(row, self.now, self.now))

    # ---- invariants ----------------------------------------------------------------------------------------

    @invariant()
    def one_running_or_due_per_key(self) -> None:
        for key in KEYS:
            live = [t for t in self.of_key(key) if t.status in (Status.PENDING, Status.IN_FLIGHT)]
            assert len(live) <= 1, f"{key!r}: {[(t.order_seq, t.status) for t in live]}"

    @invariant()
    def no_parked_task_is_stranded(self) -> None:
        for key in KEYS:
            tasks = self.of_key(key)
            if any(t.status == Status.PARKED for t in tasks):
                assert any(t.status in (Status.PENDING, Status.IN_FLIGHT) or (t.status == Status.DEAD and t.order_hold)
                           for t in tasks), f"{key!r}: parked with nothing to release them: " \
                                            f"{[(t.order_seq, t.status, t.order_hold) for t in tasks]}"


Ordering.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
TestOrdering = Ordering.TestCase
