"""Per-key ordering under random interleavings (SPEC §12), property-based, on a real SQLite store.

Records of a few keys — binary ones, whose base64 holds `/`, and the empty key — arrive and are run inline or
parked the way a lane decides: by the lane's *own* idea of which keys are blocked (blocked when a record becomes a
task, read back from the store after a restart, blocked by a redrive, unblocked by a refresh when the store says
the key is free), not by asking the store each time. Tasks are claimed and succeed, fail or die; heads are skipped
or redriven, one at a time or in bulk; dead tasks are published and purged, and redriven again from their DLQ
record; open tasks time out; the store is restored from the changelog's record of every task; and the bridge
"crashes" (the store closed and opened again, leases lost, the lane's keys read back). After every step: never two
tasks of a key running or due at once; a record runs only when nothing earlier of its key is open (parked, running,
due, or dead and holding the key); no parked task is left without a head that will release it.

Items 5-15 of issue 23 each break one of these (binary keys: the lane's keys read back; a write retried after the
store failed, alone or as one task of a partly failed batch; a restore that releases a held key; a bulk redrive out
of order; a redrive from a DLQ record without its place; a dead non-head holding; a redrive beside a record the
lane runs inline).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bridge.changelog.local import LocalIndex
from bridge.model import ErrorInfo, NewTask, Outcome, Status, Task, key_of_order_key, order_key_of
from bridge.store.results import RunReport
from bridge.store.tasks import Store

# b"ab?" is YWI/ and b"?\xff" is P/8= in base64 (a `/` inside). Two keys: a bug needs a few steps of one key.
KEYS = [b"ab?", b"?\xff"]
HOLD = {b"ab?": False, b"?\xff": True}  # on_dead per key (two queues' worth)
LEASE = 1.0
HOME = ("t", 0)
RETAIN_MS = 10  # the sweep's retention (task_ttl) here: one tick


class Ordering(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="rdq-ordering-"))
        self.store: Store = self.run(Store.open(self.dir / "rdq.db", synchronous="NORMAL"))
        self.now = 1_000_000
        self.offset = 0
        self.ids: list[str] = []
        self.hold = HOLD
        self.finished_inline: dict[bytes, list[int]] = {k: [] for k in KEYS}
        self.ran: list[tuple[bytes, int]] = []  # every handler run (inline or claimed), in order
        self.lane_blocked: set[bytes] = set()  # the lane's own view (bridge/lanes.py), not the store's
        self.purged: list[Task] = []  # dead tasks whose DLQ record was acknowledged and which were purged
        self.ahead: dict[str, set[str]] = {}  # a redriven task → the tasks of its key running or due at its redrive
        self.gone: set[str] = set()  # purged (their DLQ record acknowledged): the only tasks allowed to leave
        self.unstored: dict[bytes, list[NewTask]] = {}  # a key's tasks whose store write failed, to be retried
        self.back: dict[str, int] = {}  # a task put back from its DLQ record → when

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

    def has(self, *statuses: str) -> bool:
        """Some task is in one of these states (a rule's precondition: steps that do nothing are not drawn)."""
        marks = ",".join("?" * len(statuses))
        sql = f"SELECT 1 FROM tasks WHERE status IN ({marks}) LIMIT 1"
        return bool(self.run(self.store.db.read(lambda c: c.execute(sql, statuses).fetchall())))

    def of_key(self, key: bytes) -> list[Task]:
        return [t for t in self.tasks() if t.order_key == order_key_of(*HOME, key)]

    def blocked(self, key: bytes) -> bool:
        return bool(self.run(self.store.order_open_of([order_key_of(*HOME, key)])))  # type: ignore[list-item]

    def _new(self, key: bytes, status: Status, dead: bool = False) -> NewTask:
        now = self.tick()
        return NewTask(queue="q", handler_ref="h", payload=b"{}",
                       headers={"rdq.source": f"kafka://t/0/{self.offset}"},
                       status=status, created_at=now, first_attempt=None,
                       next_attempt_at=now if status == Status.PENDING else None,
                       dead_reason=ErrorInfo("Boom", "permanent") if dead else None,
                       order_key=order_key_of(*HOME, key), order_seq=self.offset, order_hold=self.hold[key])

    def check_runnable(self, key: bytes, seq: int, task_id: str | None = None) -> None:
        """A record of `key` runs (`task_id`: as a task; else inline): nothing of its key runs or is due beside it,
        nothing earlier of its key waits parked or holds the key dead."""
        self.ran.append((key, seq))
        for task in self.of_key(key):
            if task.order_seq == seq:
                continue
            assert not (task.status in (Status.PENDING, Status.IN_FLIGHT) and task.order_seq is not None
                        and task.order_seq != seq), f"{key!r}/{seq} runs beside {task.order_seq} ({task.status})"
            assert task.order_seq is not None
            if task.status == Status.PARKED and task.order_seq < seq:
                # Only a redriven head of a key that had moved on (on_dead: release) waits behind a later record:
                # the one running or due when it was redriven.
                assert task_id is not None and task_id in self.ahead.get(task.id, ()), \
                    f"{key!r}/{seq} runs before the earlier parked {task.order_seq}"
            if task.status == Status.DEAD and task.order_hold:
                assert task.order_seq > seq, \
                    f"{key!r}/{seq} runs while the earlier {task.order_seq} is dead and holds its key"

    def redriving(self, ids: list[str]) -> None:
        """Before a redrive: the engine blocks the tasks' keys in the lane (Engine.before_redrive), and what of each
        key is running or due now may go first."""
        for key in KEYS:
            tasks = self.of_key(key)
            mine = [t.id for t in tasks if t.id in ids]
            if mine:
                self.lane_blocked.add(key)
                live = {t.id for t in tasks if t.status in (Status.PENDING, Status.IN_FLIGHT)}
                for task_id in mine:
                    self.ahead[task_id] = live

    # ---- the lane's side: a record arrives --------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS), fails=st.sampled_from(["no", "retry", "dead"]))
    def arrive(self, key: bytes, fails: str, store_fails: bool = False) -> None:
        if self.unstored.get(key):
            return  # the lane holds the key's next record until its task is in the store (Lane._storing)
        self.offset += 1
        if key in self.lane_blocked:
            self.store_task(key, self._new(key, Status.PARKED), store_fails)
            return
        self.check_runnable(key, self.offset)
        if fails == "no":
            self.finished_inline[key].append(self.offset)
        else:
            status = Status.DEAD if fails == "dead" else Status.PENDING
            self.lane_blocked.add(key)  # its record became a task: its later records park
            self.store_task(key, self._new(key, status, dead=fails == "dead"), store_fails)

    @rule(key=st.sampled_from(KEYS), fails=st.sampled_from(["no", "retry", "dead"]))
    def arrive_while_the_store_fails(self, key: bytes, fails: str) -> None:
        """The store write of this record's task fails (a full disk, a locked file): retried later, in order."""
        self.arrive(key, fails, store_fails=True)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=2, max_size=4), broken=st.integers(0, 3),
          fails=st.sampled_from(["retry", "dead"]))
    def arrive_in_one_batch(self, keys: list[bytes], broken: int, fails: str) -> None:
        """A poll's failing records, their tasks written in one batch (`submit_many`), where one write fails alone
        (a value SQLite cannot bind: the batch falls back to a savepoint per task) and is retried later (item 8)."""
        batch: list[tuple[bytes, NewTask]] = []
        for key in keys:
            if self.unstored.get(key) or any(k == key for k, _ in batch):
                continue  # the lane holds a key's next record until its task is in the store (Lane._storing)
            self.offset += 1
            if key in self.lane_blocked:
                batch.append((key, self._new(key, Status.PARKED)))
                continue
            self.check_runnable(key, self.offset)
            self.lane_blocked.add(key)
            batch.append((key, self._new(key, Status.DEAD if fails == "dead" else Status.PENDING, fails == "dead")))
        if not batch:
            return
        broken %= len(batch)
        written = [dataclasses.replace(task, order_seq=2**70) if i == broken else task
                   for i, (_, task) in enumerate(batch)]  # 2**70: more than an SQLite INTEGER holds
        errors = self.run(self.store.submit_many(written))
        for i, ((key, task), error) in enumerate(zip(batch, errors, strict=True)):
            assert (error is not None) == (i == broken), f"write {i} of {len(batch)}: {error}"
            if error is None:
                self.stored(task.id)
            else:
                self.unstored.setdefault(key, []).append(task)

    @precondition(lambda self: any(self.unstored.values()))
    @rule(twice=st.booleans())
    def store_recovers(self, twice: bool) -> None:
        """The writes that failed go again, in order; `twice`: the failed write had in fact committed (its answer was
        lost), so the retry finds its task there already."""
        for waiting in self.unstored.values():
            for task in waiting:
                if twice:
                    self.stored(self.run(self.store.submit(task)))
                self.stored(self.run(self.store.submit(task)))
            waiting.clear()

    def store_task(self, key: bytes, task: NewTask, fails: bool) -> None:
        if fails:
            self.unstored.setdefault(key, []).append(task)
        else:
            self.stored(self.run(self.store.submit(task)))

    def stored(self, task_id: str) -> None:
        if task_id not in self.ids:
            self.ids.append(task_id)

    @precondition(lambda self: bool(self.lane_blocked))
    @rule()
    def refresh_keys(self) -> None:
        """The lane's refresh: blocked keys the store finds with no open task run inline again."""
        # Not a key with a task on its way into the store (Lane.blocked_keys leaves those out).
        asked = {k for k in self.lane_blocked if not self.unstored.get(k)}
        if asked:
            still = self.run(self.store.order_open_of([order_key_of(*HOME, k) for k in asked]))
            self.lane_blocked -= {k for k in asked if order_key_of(*HOME, k) not in still}

    # ---- the scheduler's side ---------------------------------------------------------------------------

    @precondition(lambda self: self.has("PENDING"))
    @rule(outcome=st.sampled_from([Outcome.SUCCESS, Outcome.RETRYABLE_FAILURE, Outcome.PERMANENT_FAILURE]))
    def claim_and_end(self, outcome: Outcome) -> None:
        for task in self.run(self.store.claim_due("q", 10, LEASE, "w", self.tick())):
            key = next(k for k in KEYS if task.order_key == order_key_of(*HOME, k))
            assert task.order_seq is not None
            self.check_runnable(key, task.order_seq, task.id)
            now = self.tick()
            report = RunReport(now, now, outcome, None if outcome == Outcome.SUCCESS else ErrorInfo("Boom", "x"),
                               "w")
            if outcome == Outcome.SUCCESS:
                self.run(self.store.record_success(task.id, task.lease_token, task.attempt_count, report))
            elif outcome == Outcome.RETRYABLE_FAILURE:
                self.run(self.store.record_retry(task.id, task.lease_token, report, now))
            else:
                self.run(self.store.record_dead(task.id, task.lease_token, report, ErrorInfo("Boom", "x")))

    @precondition(lambda self: self.has("DEAD"))
    @rule(key=st.sampled_from(KEYS))
    def skip_head(self, key: bytes) -> None:
        for task in self.of_key(key):
            self.run(self.store.skip(task.id))

    @precondition(lambda self: self.has("DEAD"))
    @rule(key=st.sampled_from(KEYS), which=st.integers(0, 3))
    def redrive_dead(self, key: bytes, which: int) -> None:
        dead = [t for t in self.of_key(key) if t.status == Status.DEAD]
        if dead:
            chosen = dead[which % len(dead)].id
            self.redriving([chosen])
            self.run(self.store.redrive(chosen, self.tick()))

    @precondition(lambda self: self.has("DEAD"))
    @rule()
    def bulk_redrive(self) -> None:
        """`rdq redrive --queue q`: the queue's dead tasks in the store's order, in one transaction."""
        ids = self.run(self.store.dead_ids("q"))
        self.redriving(ids)
        self.run(self.store.redrive_many(ids, self.tick()))

    @precondition(lambda self: self.has("DEAD"))
    @rule()
    def publish_and_purge(self) -> None:
        """A dead task's DLQ record is acknowledged and the store purges it (a held key is released)."""
        for task in self.tasks():
            if task.status == Status.DEAD:
                self.run(self.store.mark_dlq_published(task, "dlq", 0, len(self.purged), self.tick()))
                published = self.run(self.store.get(task.id))
                if self.run(self.store.purge_task(task.id)):
                    self.purged.append(published)
                    self.gone.add(task.id)
                return

    @precondition(lambda self: bool(self.purged))
    @rule(redrive=st.booleans())
    def redrive_from_dlq(self, redrive: bool) -> None:
        """`rdq redrive --from-dlq`: a purged task re-created from its envelope, then redriven; or `rdq import` of
        its DLQ record: re-created and left DEAD for an operator (a sweep may come first)."""
        if self.purged:
            envelope = self.purged.pop(0)
            self.run(self.store.recreate_dead(envelope, "dlq", 0, 0, self.now))
            self.back[envelope.id] = self.now
            self.gone.discard(envelope.id)
            if redrive:
                self.redriving([envelope.id])
                self.run(self.store.redrive(envelope.id, self.tick()))

    @rule()
    def sweep(self) -> None:
        """The sweep's purge of finished tasks past retention: SUCCEEDED, or DEAD with the DLQ record acknowledged,
        kept RETAIN_MS from their finish, or from when they were put back from their DLQ record if later (counted
        from the death, an import of an old DLQ was purged at once, and a redrive's re-created task before its
        redrive). Exactly those go."""
        cutoff = self.tick() - RETAIN_MS
        before = self.tasks()
        due = {t.id: t for t in before if (t.status == Status.SUCCEEDED or (t.status == Status.DEAD
                                                                             and t.dlq_state == "PUBLISHED"))
               and t.finished_at is not None and t.finished_at < cutoff and self.back.get(t.id, 0) < cutoff}
        self.run(self.store.purge("q", "finished", cutoff))
        purged = {t.id for t in before} - {t.id for t in self.tasks()}
        assert purged == set(due), f"purged {sorted(purged)}, expected {sorted(due)}"
        self.gone |= purged
        self.purged += [t for t in due.values() if t.status == Status.DEAD]

    @precondition(lambda self: self.has("PENDING", "IN_FLIGHT", "PARKED"))
    @rule()
    def time_out(self) -> None:
        """queue_timeout: every open task (parked ones too) dies as rdq.Timeout."""
        self.run(self.store.time_out("q", self.now + 1, self.tick(), "queue_timeout"))

    @rule(split=st.integers(1, 4))
    def restore(self, split: int) -> None:
        """A restore from the changelog's record of every task (as an owner would have written it), in batches:
        it replays states and must change none (a held dead head re-inserted releases nothing)."""
        local = LocalIndex(self.store)
        before = {t.id: (t.status, t.order_hold) for t in self.tasks()}

        def records(conn: Any) -> list[tuple[int, bytes, bytes | None]]:
            rows = conn.execute("SELECT * FROM tasks").fetchall()
            return [(i, row["id"].encode(), LocalIndex._entry(conn, row).value) for i, row in enumerate(rows)]

        log = self.run(self.store.db.read(records))
        self.run(local.restore_begin(HOME))
        size = max(1, len(log) // split)
        for start in range(0, len(log), size):
            self.run(local.restore_batch(HOME, "cl", log[start:start + size], self.tick(), []))
        after = {t.id: (t.status, t.order_hold) for t in self.tasks()}
        assert after == before, f"the restore changed states: {before} → {after}"

    @rule()
    def crash(self) -> None:
        """The bridge dies: the store is closed and opened again; leases held are lost (reclaimed at once)."""
        self.run(self.store.close())
        self.store = self.run(Store.open(self.dir / "rdq.db", synchronous="NORMAL"))
        self.now += int(LEASE * 1000) + 1
        for row in self.run(self.store.lapsed_leases(self.now)):
            self.run(self.store.expire_lease(row, self.now, self.now))
        # The new lane reads its partition's open keys back from the store, as the consumer does (_load_keys).
        self.lane_blocked = {key_of_order_key(k) for k in self.run(self.store.order_open_keys(*HOME, "q"))}
        # A record whose task was never stored was never committed: redelivered first, it fails again the same way
        # and its task is stored now (parked if its key is still held, else due at once).
        for key, waiting in self.unstored.items():
            for task in waiting:
                self.stored(self.run(self.store.submit(task)))
            if waiting:
                self.lane_blocked.add(key)
            waiting.clear()

    # ---- invariants ----------------------------------------------------------------------------------------

    @invariant()
    def one_running_or_due_per_key(self) -> None:
        for key in KEYS:
            live = [t for t in self.of_key(key) if t.status in (Status.PENDING, Status.IN_FLIGHT)]
            assert len(live) <= 1, f"{key!r}: {[(t.order_seq, t.status) for t in live]}"

    @invariant()
    def nothing_stored_is_lost(self) -> None:
        """Every task the store took is still there unless it was purged after its DLQ record was acknowledged (a
        retried write, a restore, a redrive from the DLQ record: none may drop one)."""
        present = set(self.run(self.store.db.read(lambda c: [r[0] for r in c.execute("SELECT id FROM tasks")])))
        missing = set(self.ids) - present - self.gone
        assert not missing, f"tasks lost: {sorted(missing)}"

    @invariant()
    def no_parked_task_is_stranded(self) -> None:
        for key in KEYS:
            tasks = self.of_key(key)
            if any(t.status == Status.PARKED for t in tasks):
                assert any(t.status in (Status.PENDING, Status.IN_FLIGHT) or (t.status == Status.DEAD and t.order_hold)
                           for t in tasks), f"{key!r}: parked with nothing to release them: " \
                                            f"{[(t.order_seq, t.status, t.order_hold) for t in tasks]}"


Ordering.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
TestOrdering = Ordering.TestCase
