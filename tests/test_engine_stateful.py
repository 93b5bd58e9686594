"""Random interleavings of submit, claim, heartbeat, success, failure, lease expiry, sweep, redrive and stale-token
results against a real SQLite store with a fake clock; the lifecycle invariants are checked after every step."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bridge.clock import FakeClock
from bridge.config import parse_config
from bridge.engine.policy import decide
from bridge.engine.sweep import Sweeper
from bridge.live_config import LiveConfig
from bridge.model import Attempt, ErrorInfo, NewTask, Outcome, Status, Task
from bridge.store.results import RunReport
from bridge.store.tasks import Store

MAX_ATTEMPTS = 3
DELAYS = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**400), 10**400))


@dataclass
class Holder:
    """A worker that claimed a task at some point: its token may have gone stale since."""

    task_id: str
    token: int
    attempt_no: int


def _snapshot(task: Task) -> tuple[Any, ...]:
    return (task.status, task.attempt_count, task.redrive_count, task.attempts, task.dead_reason)


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="rdq-stateful-"))
        self.clock = FakeClock()
        config = parse_config({
            "kafka": {"bootstrap_servers": "x:1"},
            "queues": {"q": {"handler": "h", "max_attempts": MAX_ATTEMPTS, "lease": "1s",
                             "backoff": {"kind": "fixed", "base": "100ms", "jitter": "none"},
                             "queue_timeout": "20s", "task_ttl": "5s"}},
        })
        self.config = LiveConfig(config)
        self.store: Store = self.run(Store.open(self.dir / "rdq.db", synchronous="NORMAL"))
        self.sweeper = Sweeper(self.store, self.config, self.clock, rand=lambda: 1.0)
        self.ids: list[str] = []
        self.holders: list[Holder] = []
        self.finished_epochs: set[tuple[str, int]] = set()
        self.before: dict[str, Task] = {}
        self.redriven: set[str] = set()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def tasks(self) -> dict[str, Task]:
        out = {}
        for task_id in self.ids:
            task = self.run(self.store.get(task_id))
            if task is not None:
                out[task_id] = task
        return out

    def step(self) -> None:
        """Remember the state before a rule, to check what the rule was allowed to change."""
        self.before = self.tasks()
        self.redriven = set()

    def report(self, outcome: Outcome) -> RunReport:
        now = self.clock.now_ms()
        error = None if outcome == Outcome.SUCCESS else ErrorInfo("E", "failed")
        return RunReport(now, now, outcome, error, "w")

    # ---- rules ---------------------------------------------------------------------------------------------

    @rule(due_in=st.integers(0, 3000), dead=st.booleans())
    def submit(self, due_in: int, dead: bool) -> None:
        self.step()
        now = self.clock.now_ms()
        first = Attempt(1, 0, now, now, Outcome.PERMANENT_FAILURE if dead else Outcome.RETRYABLE_FAILURE,
                        ErrorInfo("E", "first"), "consumer")
        source = {"rdq.source": f"kafka://t/0/{len(self.ids)}"}
        task = NewTask("q", "h", b"p", source, Status.DEAD if dead else Status.PENDING, now, first,
                       None if dead else now + due_in, ErrorInfo("E", "first") if dead else None)
        self.ids.append(self.run(self.store.submit(task)))

    @rule(limit=st.integers(1, 4))
    def claim(self, limit: int) -> None:
        self.step()
        for task in self.run(self.store.claim_due("q", limit, 1.0, "w", self.clock.now_ms())):
            assert self.before[task.id].status == Status.PENDING
            self.holders.append(Holder(task.id, task.lease_token, task.attempt_count))

    @rule(ms=st.integers(1, 4000))
    def advance(self, ms: int) -> None:
        self.step()
        self.clock.ms += ms

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        self.step()
        holder = data.draw(st.sampled_from(self.holders))
        accepted = self.run(self.store.extend_lease(holder.task_id, holder.token, 1.0, self.clock.now_ms()))
        self.check_stale(holder, accepted, may_accept=self.is_current(holder, live=True))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def success(self, data: st.DataObject) -> None:
        self.step()
        holder = data.draw(st.sampled_from(self.holders))
        result = self.run(self.store.record_success(holder.task_id, holder.token, holder.attempt_no,
                                                    self.report(Outcome.SUCCESS)))
        before = self.before.get(holder.task_id)
        # First result wins: accepted exactly when the task was not terminal (late successes included).
        assert result.accepted == (before is not None and not before.status.terminal)
        if result.accepted:
            assert before is not None
            epoch = (holder.task_id, before.redrive_count)
            assert epoch not in self.finished_epochs, "finished twice"
            self.finished_epochs.add(epoch)

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), permanent=st.booleans(), delay=DELAYS)
    def failure(self, data: st.DataObject, permanent: bool, delay: float | int | None) -> None:
        """A holder fails, maybe asking for a delay of its own: huge, infinite, negative and NaN included."""
        self.step()
        self.fail_as(data.draw(st.sampled_from(self.holders)), permanent, delay)

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), token=st.one_of(st.integers(-(2**63), 0), st.integers(1, 2**62)))
    def forged_success(self, data: st.DataObject, token: int) -> None:
        """A success with a token never issued for that task (0, negative, or past the current one): refused,
        nothing changes. (A token within 1..current was issued: that is a late success, the `success` rule.)"""
        self.step()
        task_id = data.draw(st.sampled_from(self.ids))
        before = self.before.get(task_id)
        if before is not None and 1 <= token <= before.lease_token:
            token = before.lease_token + token  # past the current one: never issued
        result = self.run(self.store.record_success(task_id, token, 1, self.report(Outcome.SUCCESS)))
        assert not result.accepted, "a forged token finished a task"
        assert self.run(self.store.get(task_id)) == before

    @precondition(lambda self: any(not self.holds_now(h) for h in self.holders))
    @rule(data=st.data(), permanent=st.booleans())
    def stale_failure(self, data: st.DataObject, permanent: bool) -> None:
        """A zombie worker reports a failure: its lease was reclaimed, re-claimed or finished since."""
        self.step()
        self.fail_as(data.draw(st.sampled_from([h for h in self.holders if not self.holds_now(h)])), permanent)

    def holds_now(self, holder: Holder) -> bool:
        task = self.run(self.store.get(holder.task_id))
        return task is not None and task.status == Status.IN_FLIGHT and task.lease_token == holder.token

    def fail_as(self, holder: Holder, permanent: bool, delay: float | int | None = None) -> None:
        before = self.before.get(holder.task_id)
        queue = self.config.queue("q")
        assert queue is not None
        outcome = Outcome.PERMANENT_FAILURE if permanent else Outcome.RETRYABLE_FAILURE
        decision = decide(queue, outcome, holder.attempt_no, delay, rand=lambda: 1.0)
        report = self.report(outcome)
        if decision.retry_after is None:
            result = self.run(self.store.record_dead(holder.task_id, holder.token, report, ErrorInfo("E", "x")))
        else:
            next_at = self.clock.now_ms() + int(decision.retry_after * 1000)
            result = self.run(self.store.record_retry(holder.task_id, holder.token, report, next_at))
        self.check_stale(holder, result.accepted, may_accept=self.is_current(holder, live=False))
        if result.accepted:
            assert before is not None and before.status == Status.IN_FLIGHT

    @rule()
    def sweep(self) -> None:
        self.step()
        self.run(self.sweeper.sweep_once())
        for task_id, before in self.before.items():
            after = self.run(self.store.get(task_id))
            if after is None:  # purged: only finished tasks whose DLQ record (if any) was acknowledged
                assert before.status.terminal and before.dlq_state != "PENDING"

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def redrive(self, data: st.DataObject) -> None:
        self.step()
        task_id = data.draw(st.sampled_from(self.ids))
        before = self.before.get(task_id)
        ok = self.run(self.store.redrive(task_id, self.clock.now_ms(), "sre", "r"))
        assert ok == (before is not None and before.status == Status.DEAD)
        if ok:
            self.redriven.add(task_id)

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def publish_dlq(self, data: st.DataObject) -> None:
        self.step()
        for task in self.run(self.store.dlq_outbox(limit=data.draw(st.integers(1, 3)))):
            assert task.status == Status.DEAD
            assert self.run(self.store.mark_dlq_published(task, "q.dlq", 0, 1, self.clock.now_ms()))

    # ---- helpers and invariants ----------------------------------------------------------------------------

    def is_current(self, holder: Holder, live: bool) -> bool:
        before = self.before.get(holder.task_id)
        if before is None or before.status != Status.IN_FLIGHT or before.lease_token != holder.token:
            return False
        assert before.lease_expires_at is not None
        return before.lease_expires_at > self.clock.now_ms() if live else True

    def check_stale(self, holder: Holder, accepted: bool, may_accept: bool) -> None:
        """A stale token never changes anything (an accepted late success is checked in `success`)."""
        if not may_accept:
            assert not accepted, "a stale token was accepted"
            after = self.run(self.store.get(holder.task_id))
            before = self.before.get(holder.task_id)
            assert (after is None) == (before is None)
            if after is not None and before is not None:
                assert after == before, "a refused operation changed the task"
        else:
            assert accepted

    @invariant()
    def lifecycle_holds(self) -> None:
        conn = sqlite3.connect(self.dir / "rdq.db")
        try:
            statuses = dict(conn.execute("SELECT id, status FROM tasks").fetchall())
        finally:
            conn.close()
        assert self.store.writable
        for task_id, task in self.tasks().items():
            # A requested delay never parks a task past the queue's bounds (queue_timeout 20 s here).
            if task.next_attempt_at is not None:
                assert task.next_attempt_at <= self.clock.now_ms() + 20_000
            # Every task is in exactly one status, with the fields that status requires.
            assert statuses[task_id] == task.status.value
            assert (task.status == Status.IN_FLIGHT) == (task.lease_expires_at is not None)
            assert task.status.terminal == (task.next_attempt_at is None)
            # attempt_count equals the attempts since the last redrive (+ the one running).
            epoch = [a for a in task.attempts if a.redrive_no == task.redrive_count]
            running = 1 if task.status == Status.IN_FLIGHT else 0
            assert task.attempt_count == len(epoch) + running, (task.attempt_count, epoch, task.status)
            assert [a.attempt_no for a in epoch] == list(range(1, len(epoch) + 1))
            assert task.attempt_count <= MAX_ATTEMPTS + 1
            # No task is finished twice: at most one SUCCESS per redrive epoch, and only as the last attempt.
            successes = [a for a in epoch if a.outcome == Outcome.SUCCESS]
            assert len(successes) <= 1
            if successes:
                assert task.status == Status.SUCCEEDED and epoch[-1].outcome == Outcome.SUCCESS
            # A terminal task changes only by redrive.
            before = self.before.get(task_id)
            if before is not None and before.status.terminal and task_id not in self.redriven:
                assert _snapshot(task) == _snapshot(before), "a terminal task changed without a redrive"
            # History is appended, never rewritten.
            if before is not None:
                assert task.attempts[: len(before.attempts)] == before.attempts


Lifecycle.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
TestLifecycle = Lifecycle.TestCase
