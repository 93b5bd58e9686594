"""The SQLite side of the changelog (SPEC §10): versions, the outbox, homes, restore rules, the record format.

Real SQLite on disk; no broker (the Kafka side is in test_changelog_kafka.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from bridge.changelog.codec import SCHEMA, Unreadable, decode
from bridge.changelog.local import Entry, HomeState, LocalIndex
from bridge.model import ErrorInfo, NewTask, Outcome, Status
from bridge.store.tasks import Store
from tests.helpers import T0, failure, report

HOME = ("src", 0)


def on(topic: str, partition: int, offset: int, due_in_ms: int = 0, dead: ErrorInfo | None = None) -> NewTask:
    task = failure(due_in_ms=due_in_ms, dead=dead)
    headers = {**task.headers, "rdq.source": f"kafka://{topic}/{partition}/{offset}", "rdq.kafka.timestamp": "7"}
    return type(task)(**{**task.__dict__, "headers": headers})


async def scoped_store(tmp_path: Path) -> tuple[Store, LocalIndex]:
    store = await Store.open(tmp_path / "rdq.db", scoped=True)
    local = LocalIndex(store)
    await local.set_changelogged(["src"])
    return store, local


async def test_every_transition_is_in_the_outbox_but_a_heartbeat_is_not(tmp_path: Path) -> None:
    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        task = on("src", 0, 1)
        await store.submit(task)
        [entry] = await local.outbox(10)
        assert entry.task_id == task.id and entry.home == HOME and entry.version == 1
        await local.mark_logged([entry])
        assert await local.outbox(10) == []
        [claimed] = await store.claim_due("q", 10, 30, "w", T0)
        [entry] = await local.outbox(10)  # the claim is logged: a restore elsewhere sees the lease
        assert entry.version == 2 and json.loads(entry.value or b"")["task"]["status"] == "IN_FLIGHT"
        await local.mark_logged([entry])
        assert await store.extend_lease(task.id, claimed.lease_token, 30, T0 + 1)
        assert await local.outbox(10) == []  # a heartbeat is not a transition worth a record
        await store.record_retry(task.id, claimed.lease_token, report(Outcome.RETRYABLE_FAILURE), T0 + 5)
        [entry] = await local.outbox(10)
        body = json.loads(entry.value or b"")
        assert entry.version == 3 and body["schema"] == SCHEMA
        assert [a["attempt_no"] for a in body["attempts"]] == [1, 2]
    finally:
        await store.close()


async def test_the_outbox_encodes_a_task_as_one_read_by_name_does(tmp_path: Path) -> None:
    """The outbox's records (built by SQLite) must be the ones the one-task path (a DLQ snapshot, the
    premigration) encodes from `sqlite3.Row`s: the same JSON (the bytes differ in field order only)."""
    from bridge.store.queries import q

    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        task = on("src", 0, 1)
        await store.submit(task)
        [claimed] = await store.claim_due("q", 10, 30, "w", T0)
        await store.record_retry(task.id, claimed.lease_token, report(Outcome.RETRYABLE_FAILURE), T0 + 5)
        [entry] = await local.outbox(10)
        one = await store.db.read(lambda c: LocalIndex._entry(c, c.execute(q("get_task"), {"id": task.id}).fetchone()))
        assert (entry.task_id, entry.home, entry.version) == (one.task_id, one.home, one.version)
        assert json.loads(entry.value or b"") == json.loads(one.value or b"")
        assert len(json.loads(entry.value or b"")["attempts"]) == 2
    finally:
        await store.close()


async def test_unlogged_names_the_tasks_whose_last_transition_is_not_acknowledged(tmp_path: Path) -> None:
    """What the changelog writer asks before letting a source offset pass a task (one query for the batch)."""
    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        logged, waiting, moved_on = on("src", 0, 1), on("src", 0, 2), on("src", 0, 3)
        for task in (logged, waiting, moved_on):
            await store.submit(task)
        await local.mark_logged([e for e in await local.outbox(10) if e.task_id != waiting.id])
        assert await local.unlogged([logged.id, waiting.id, moved_on.id, "no-such-task"]) == {waiting.id}
        await store.claim_due("q", 10, 30, "w", T0)  # a new transition of each: none is acknowledged now
        assert await local.unlogged([logged.id, moved_on.id]) == {logged.id, moved_on.id}
        assert await local.unlogged([]) == set()
    finally:
        await store.close()


async def test_the_next_due_time_is_of_the_tasks_a_claim_may_take(tmp_path: Path) -> None:
    """A partition being restored holds tasks due long ago that no claim may take: the claim loop asked when the
    next one was due, was told "now", claimed nothing and asked again, for ever (a restore of due tasks ran at half
    its speed, the claims scanning them in the writer's transactions)."""
    store, local = await scoped_store(tmp_path)
    try:
        restoring, later, elsewhere = on("src", 1, 1), on("src", 0, 2, 5_000), on("elsewhere", 0, 3, 2_000)
        await store.submit(restoring)
        assert await store.next_due_at("q") is None  # its partition is not active here: not claimable
        assert await store.claim_due("q", 10, 30, "w", T0 + 1) == []
        await store.submit(later)
        await local.set_home(HOME, HomeState.ACTIVE)
        assert await store.next_due_at("q") == T0 + 5_000  # the active partition's, not the restoring one's
        await store.submit(elsewhere)  # its topic has no changelog: always this file's to run
        assert await store.next_due_at("q") == T0 + 2_000
        await local.set_home(("src", 1), HomeState.ACTIVE)  # restored: its task is the first due
        assert await store.next_due_at("q") == T0
        claimed = [t.id for t in await store.claim_due("q", 10, 30, "w", T0 + 5_000)]
        assert claimed == [restoring.id, elsewhere.id, later.id]
    finally:
        await store.close()

async def test_only_active_homes_are_claimed_logged_or_swept(tmp_path: Path) -> None:
    store, local = await scoped_store(tmp_path)
    try:
        mine, theirs, homeless = on("src", 0, 1), on("src", 1, 1), failure()
        for task in (mine, theirs, homeless):
            await store.submit(task)
        await local.set_home(HOME, HomeState.ACTIVE)
        claimed = {t.id for t in await store.claim_due("q", 10, 30, "w", T0)}
        # Partition 1 is not this instance's; a task whose topic has no changelog stays this file's to run.
        assert claimed == {mine.id, homeless.id}
        assert {e.task_id for e in await local.outbox(10)} == {mine.id}
        await local.set_home(HOME, HomeState.LEAVING)  # revoked: nothing new starts, its last transitions still go out
        await store.record_retry(mine.id, 1, report(Outcome.RETRYABLE_FAILURE), T0)
        assert await store.claim_due("q", 10, 30, "w", T0 + 10) == []
        assert {e.task_id for e in await local.outbox(10)} == {mine.id}
    finally:
        await store.close()


async def test_a_purge_leaves_a_tombstone_for_the_changelog(tmp_path: Path) -> None:
    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        task = on("src", 0, 1, dead=ErrorInfo("E", "m"))
        await store.submit(task)
        await store.mark_dlq_published(await store.get(task.id), "dlq", 0, 0, T0)  # type: ignore[arg-type]
        assert await store.purge_task(task.id)
        [tomb] = await local.tombstones(10)
        assert tomb.task_id == task.id and tomb.value is None and tomb.home == HOME
        await local.mark_logged([tomb])
        assert await local.tombstones(10) == []
    finally:
        await store.close()


async def test_a_dlq_publish_in_the_changelog_transaction_is_marked_logged(tmp_path: Path) -> None:
    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        task = on("src", 0, 1, dead=ErrorInfo("E", "m"))
        await store.submit(task)
        published = await local.snapshot_published(task.id, "dlq", 2, 9, T0)
        assert published is not None and published.version == 2
        assert json.loads(published.value or b"")["task"]["dlq_state"] == "PUBLISHED"
        await local.mark_logged([type(published)(task.id, HOME, 1, b"")])
        stored = await store.get(task.id)
        assert stored is not None and await store.mark_dlq_published(stored, "dlq", 2, 9, T0, logged=True)
        assert await local.outbox(10) == []  # the mark and its changelog record went out together
    finally:
        await store.close()


async def test_restore_the_changelog_wins_keeps_never_logged_and_drops_purged(tmp_path: Path) -> None:
    # Instance A writes the changelog.
    a, a_local = await scoped_store(tmp_path / "a")
    await a_local.set_home(HOME, HomeState.ACTIVE)
    kept, later_purged = on("src", 0, 1), on("src", 0, 2)
    for task in (kept, later_purged):
        await a.submit(task)
    records = [(i, e.task_id.encode(), e.value) for i, e in enumerate(await a_local.outbox(10))]
    [claimed] = [t for t in await a.claim_due("q", 10, 30, "a", T0) if t.id == kept.id] or [None]
    assert claimed is not None
    records += [(len(records), kept.id.encode(), (await a_local.outbox(10))[0].value)]
    await a.close()
    # Instance B has a stale copy of `kept`, a task the changelog logged and no longer holds, and one never
    # logged (its source offset was not committed: it stays, to be logged now).
    b, b_local = await scoped_store(tmp_path / "b")
    try:
        stale = await b.submit(kept)
        assert stale == kept.id
        gone, never = on("src", 0, 3), on("src", 0, 4)
        await b.submit(gone)
        await b.submit(never)
        await b_local.set_home(HOME, HomeState.ACTIVE)
        await b_local.mark_logged([e for e in await b_local.outbox(10) if e.task_id in (gone.id, kept.id)])
        await b_local.set_home(HOME, HomeState.NOT_OURS)
        await b_local.restore_begin(HOME)
        errors: list[str] = []
        batch = await b_local.restore_batch(HOME, "cl", [*records, (99, later_purged.id.encode(), None),
                                                         (100, b"x", b"not json")], T0, errors)
        assert (batch.applied, batch.tombstones, batch.unreadable) == (3, 1, 1)
        assert len(errors) == 1 and "cl/0/100" in errors[0]
        dropped = await b_local.restore_finish(HOME)
        assert dropped == 1 and await b.get(gone.id) is None
        assert await b.get(later_purged.id) is None  # its tombstone
        restored = await b.get(kept.id)
        assert restored is not None and restored.status == Status.IN_FLIGHT and restored.attempt_count == 2
        assert [x.attempt_no for x in restored.attempts] == [1]  # history as the changelog has it
        assert await b.get(never.id) is not None
        await b_local.set_home(HOME, HomeState.ACTIVE)
        assert {e.task_id for e in await b_local.outbox(10)} == {never.id}
        assert await b_local.unreadable_counts() == {"cl/0": 1}
    finally:
        await b.close()


async def test_a_restore_given_up_and_begun_again_looks_for_every_logged_task_again(tmp_path: Path) -> None:
    """What a restore has yet to find is kept in the store (restore_pending), not in memory. A restore given up
    half-way (its partition revoked) leaves its rows behind; the next restore of the partition starts from what the
    file holds then: a task the first one found, purged from the changelog since, is dropped by the second; the
    tasks still in the changelog stay, the one the first restore never reached among them."""
    store, local = await scoped_store(tmp_path)
    try:
        kept, purged, unreached = on("src", 0, 1), on("src", 0, 2), on("src", 0, 3)
        records = await _logged_records(store, local, kept, purged, unreached)
        await local.set_home(HOME, HomeState.NOT_OURS)  # a restart: not this instance's until restored
        log = {task_id: (i, task_id.encode(), json.dumps(r).encode()) for i, (task_id, r) in enumerate(records.items())}
        await local.restore_begin(HOME)
        await local.restore_batch(HOME, "cl", [log[kept.id], log[purged.id]], T0, [])  # then revoked
        # Assigned again; meanwhile `purged` was deleted and its tombstone compacted away.
        await local.restore_begin(HOME)
        await local.restore_batch(HOME, "cl", [log[kept.id], log[unreached.id]], T0, [])
        assert await local.restore_finish(HOME) == 1
        assert await store.get(purged.id) is None
        assert await store.get(kept.id) is not None and await store.get(unreached.id) is not None
        assert await store.db.read(lambda c: c.execute("SELECT COUNT(*) FROM restore_pending").fetchone()[0]) == 0
    finally:
        await store.close()


async def test_a_partition_dropped_after_a_restore_given_up_leaves_nothing_of_it(tmp_path: Path) -> None:
    """A restore given up (revoked) leaves its rows in restore_pending; the partition then handed over and dropped
    from this file takes them with it (no row of a partition this file no longer holds stays behind)."""
    store, local = await scoped_store(tmp_path)
    try:
        task = on("src", 0, 1)
        await _logged_records(store, local, task)
        await local.set_home(HOME, HomeState.NOT_OURS)
        await local.restore_begin(HOME)
        assert await store.db.read(lambda c: c.execute("SELECT COUNT(*) FROM restore_pending").fetchone()[0]) == 1
        assert await local.drop_home(HOME) == 1
        assert await store.db.read(lambda c: c.execute("SELECT COUNT(*) FROM restore_pending").fetchone()[0]) == 0
    finally:
        await store.close()


async def test_a_restore_on_the_same_disk_never_forgets_a_claim_it_made(tmp_path: Path) -> None:
    """The poison pill and changelog case: a task logged PENDING (version 1), then claimed here (version 2, not yet
    logged: the handler killed the process first). At the restart the changelog's older PENDING must not win:
    the claim stays, its lease lapses and the sweep counts it (LEASE_EXPIRED) against max_attempts. A changelog
    record of a higher version (another owner moved the task on) still wins, and so does one at a tie."""
    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        task, other, tie = on("src", 0, 1), on("src", 0, 2), on("src", 0, 3)
        for t in (task, other, tie):
            await store.submit(t)
        logged = {e.task_id: e for e in await local.outbox(10)}
        await local.mark_logged(logged.values())
        claimed = await store.claim_due("q", 10, 1, "me", T0)
        assert {t.id for t in claimed} == {task.id, other.id, tie.id}
        by_id = {e.task_id: e for e in await local.outbox(10)}
        assert by_id[task.id].version == 2
        # Elsewhere, `other` went on to version 3 (its claim there and a success); `tie` to a version 2 of its own.
        elsewhere = json.loads(by_id[other.id].value or b"")
        elsewhere["version"] = 3
        elsewhere["task"].update(status="SUCCEEDED", finished_at=T0 + 5, lease_expires_at=None, lease_owner=None,
                                 lease_started_at=None, next_attempt_at=None)
        await local.set_home(HOME, HomeState.NOT_OURS)  # the restart: not this instance's until restored
        records = [(0, task.id.encode(), logged[task.id].value), (1, other.id.encode(), logged[other.id].value),
                   (2, other.id.encode(), json.dumps(elsewhere).encode()),
                   (3, tie.id.encode(), by_id[tie.id].value.replace(b'"me"', b'"them"'))]  # type: ignore[union-attr]
        await local.restore_begin(HOME)
        await local.restore_batch(HOME, "cl", records, T0, [])
        assert await local.restore_finish(HOME) == 0
        kept = await store.get(task.id)
        assert kept is not None and kept.status == Status.IN_FLIGHT and kept.lease_owner == "me"
        moved = await store.get(other.id)
        assert moved is not None and moved.status == Status.SUCCEEDED
        tied = await store.get(tie.id)
        assert tied is not None and tied.lease_owner == "them"
        await local.set_home(HOME, HomeState.ACTIVE)
        assert [e.task_id for e in await local.outbox(10)] == [task.id]  # the kept claim is logged now
        assert task.id in {row["id"] for row in await store.lapsed_leases(T0 + 2000)}  # the sweep counts it
    finally:
        await store.close()


async def test_a_restore_does_not_release_the_record_parked_behind_a_held_dead_head(tmp_path: Path) -> None:
    """on_dead: hold. The restore replaces a task by deleting and re-inserting it: deleting the held dead head fired
    the purge trigger and released its parked record, which the changelog still has PARKED."""
    import dataclasses

    from bridge.model import order_key_of

    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        key = order_key_of("src", 0, b"k")
        dead = on("src", 0, 1, dead=ErrorInfo("Boom", "no"))
        held = dataclasses.replace(dead, order_key=key, order_seq=1, order_hold=True)
        behind = dataclasses.replace(on("src", 0, 2), status=Status.PARKED, next_attempt_at=None, first_attempt=None,
                                     order_key=key, order_seq=2, order_hold=True)
        await store.submit(held)
        await store.submit(behind)
        assert (await store.get(behind.id)).status == Status.PARKED  # type: ignore[union-attr]
        entries = await local.outbox(10)
        await local.mark_logged(entries)
        await local.set_home(HOME, HomeState.NOT_OURS)  # a restart: restored from the changelog
        records = {e.task_id: (i, e.task_id.encode(), e.value) for i, e in enumerate(entries)}
        await local.restore_begin(HOME)
        for task_id in (behind.id, held.id):  # the head's record in a later batch than its parked one's
            await local.restore_batch(HOME, "cl", [records[task_id]], T0, [])
        await local.restore_finish(HOME)
        assert (await store.get(behind.id)).status == Status.PARKED  # type: ignore[union-attr]
        assert (await store.get(held.id)).status == Status.DEAD  # type: ignore[union-attr]
        assert await store.skip(held.id) == held.order_key  # an SRE's skip still releases it
        assert (await store.get(behind.id)).status == Status.PENDING  # type: ignore[union-attr]
    finally:
        await store.close()


def test_decode_refuses_what_it_cannot_read() -> None:
    good = {"schema": SCHEMA, "version": 1, "attempts": [], "redrives": [], "task": {
        "id": "T1", "queue": "q", "handler_ref": "h", "status": "PENDING", "attempt_count": 0, "redrive_count": 0,
        "lease_token": 0, "next_attempt_at": 1, "created_at": 1, "life_started_at": 1, "headers": {"rdq.source": "kafka://t/0/1"},
        "payload": base64.b64encode(b"x").decode()}}
    assert decode(b"T1", json.dumps(good).encode()).task["source_ref"] == "kafka://t/0/1@"
    assert decode(b"T1", json.dumps(good).encode()).task["payload"] == b"x"
    newer = {**good, "schema": "rdq.task/v3"}
    # Payloads that are not strict base64: another alphabet, no padding, data after it, a space, not ASCII.
    payloads = ("!!", "eA", "eA==eA==", "e A==", "eA\n==", "é")
    for value, key in ((b"\xff\x00", b"T1"), (json.dumps(newer).encode(), b"T1"), (json.dumps(good).encode(), b"T2"),
                       *((json.dumps({**good, "task": {**good["task"], "payload": p}}).encode(), b"T1")
                         for p in payloads),
                       (b"[1, 2]", b"T1")):
        with pytest.raises(Unreadable):
            decode(key, value)


def test_decode_reads_each_field_as_the_store_types_it() -> None:
    """Decoding checks a column's type, strictly: a value the store would take as something else (a digit string,
    a float, a bool for an integer) or not at all (an object in a column: it failed the whole restore batch) makes
    the record unreadable, quarantined and kept, not a state read wrongly. A newer release's record of another
    shape is refused for its schema, so the error says what to do (roll forward)."""
    attempt = {"seq": 1, "attempt_no": 1, "redrive_no": 0, "started_at": 1, "finished_at": 2,
               "outcome": "RETRYABLE_FAILURE", "error_type": "E", "error_message": "m", "error_stack": None,
               "worker": "w", "late_result_of": None}
    good = {"schema": SCHEMA, "version": 1, "attempts": [attempt], "redrives": [], "task": {
        "id": "T1", "queue": "q", "handler_ref": "h", "status": "PENDING", "attempt_count": 1, "redrive_count": 0,
        "lease_token": 0, "next_attempt_at": 1, "created_at": 1, "life_started_at": 1, "headers": {"n": 5},
        "payload": ""}}
    restored = decode(b"T1", json.dumps(good).encode())
    assert restored.task["attempt_count"] == 1 and restored.task["headers"] == '{"n":"5"}'
    assert restored.task["payload"] == b""
    task, bad_attempts = good["task"], [
        {**attempt, "seq": True}, {**attempt, "started_at": 1.0}, {**attempt, "outcome": "MAYBE"},
        {**attempt, "error_message": ["a", "list"]}, {k: v for k, v in attempt.items() if k != "worker"}]
    bad_tasks = [{"attempt_count": "3"}, {"attempt_count": 3.0}, {"redrive_count": False}, {"lease_owner": {"a": 1}},
                 {"order_seq": "2"}, {"status": "pending"}, {"dlq_state": "SENT"}, {"id": 1}]
    for record in ([{**good, "task": {**task, **change}} for change in bad_tasks]
                   + [{**good, "attempts": [change]} for change in bad_attempts]):
        with pytest.raises(Unreadable):
            decode(b"T1", json.dumps(record).encode())
    with pytest.raises(Unreadable, match=r"unknown schema 'rdq\.task/v3'"):
        decode(b"T1", json.dumps({"schema": "rdq.task/v3", "state": {}}).encode())
    with pytest.raises(Unreadable) as refused:  # the refused value is quoted, not a megabyte of it
        decode(b"T1", json.dumps({**good, "task": {**task, "status": "X" * 100_000}}).encode())
    assert len(str(refused.value)) < 300 and str(refused.value).endswith("at `$.task.status`")


def test_a_restored_history_is_what_decoding_checked() -> None:
    """The history is kept as one value, read back by SQLite's JSON functions: written again from what was decoded,
    so a duplicate key (SQLite and the decoder could each take another of the two) or a foreign spelling is gone."""
    from bridge.store.history import unpacked

    attempt = ('{"seq": 1, "seq": 7, "attempt_no": 1, "redrive_no": 0, "started_at": 1, "finished_at": 2, '
               '"outcome": "SUCCESS", "error_type": null, "error_message": "\\u00e9", "error_stack": null, '
               '"worker": "w", "late_result_of": null}')
    task = {"id": "T1", "queue": "q", "handler_ref": "h", "status": "SUCCEEDED", "attempt_count": 1,
            "redrive_count": 0, "lease_token": 0, "created_at": 1, "life_started_at": 1, "finished_at": 2,
            "payload": ""}
    value = (f'{{"schema": "{SCHEMA}", "version": 2, "redrives": [], "task": {json.dumps(task)}, '
             f'"attempts": [{attempt}]}}')
    restored = decode(b"T1", value.encode())
    assert [a.seq for a in restored.attempts] == [7]
    assert json.loads(unpacked(restored.history) or "") == [{
        "seq": 7, "attempt_no": 1, "redrive_no": 0, "started_at": 1, "finished_at": 2, "outcome": "SUCCESS",
        "error_type": None, "error_message": "é", "error_stack": None, "worker": "w", "late_result_of": None,
        "note": None}]
    assert '"seq":1' not in (unpacked(restored.history) or "")


async def _logged_records(store: Store, local: LocalIndex, *tasks: NewTask) -> dict[str, dict]:
    """Each task's changelog record (as JSON) after it was stored and logged here."""
    await local.set_home(HOME, HomeState.ACTIVE)
    for task in tasks:
        await store.submit(task)
    entries = await local.outbox(10)
    await local.mark_logged(entries)
    return {e.task_id: json.loads(e.value or b"") for e in entries}


async def test_a_record_the_store_refuses_is_quarantined_and_the_rest_of_its_batch_is_restored(
        tmp_path: Path) -> None:
    """A record that decodes but breaks a rule of the store (an unknown status; a rule the codec does not know of,
    here two attempts of one number, or two redrives of one number, which only the redrives table's key refuses)
    failed its whole restore batch, and the partition retried for ever. The batch's rows are copied again one task
    at a time: only the refused task's are left out."""
    store, local = await scoped_store(tmp_path / "a")
    good, odd, twice, redriven = on("src", 0, 1), on("src", 0, 2), on("src", 0, 3), on("src", 0, 4)
    records = await _logged_records(store, local, good, odd, twice, redriven)
    await store.close()
    records[odd.id]["task"]["status"] = "HIBERNATING"  # a status of a newer release, under the old schema
    records[twice.id]["attempts"] *= 2  # the same attempt twice: the attempts table's key refuses it
    redrive = {"redrive_no": 1, "at": T0, "by": "sre", "request_id": None, "key_id": None}
    records[redriven.id]["redrives"] = [redrive, redrive]  # the codec reads it; the store's key refuses it
    b, b_local = await scoped_store(tmp_path / "b")
    try:
        await b_local.restore_begin(HOME)
        errors: list[str] = []
        batch = [(i, task_id.encode(), json.dumps(record).encode())
                 for i, (task_id, record) in enumerate(records.items())]
        result = await b_local.restore_batch(HOME, "cl", batch, T0, errors)
        assert (result.applied, result.unreadable) == (1, 3)
        assert await b.get(good.id) is not None and await b.get(odd.id) is None and await b.get(twice.id) is None
        assert await b.get(redriven.id) is None
        assert len(errors) == 3 and any("HIBERNATING" in e for e in errors)
        assert any("the store refused it" in e and "UNIQUE" in e for e in errors)
        assert await b_local.unreadable_counts() == {"cl/0": 3}
        assert await b_local.quarantined_counts() == {"cl/0": 3}
        assert await b.db.read(lambda c: c.execute("SELECT COUNT(*) FROM redrives").fetchone()[0]) == 0
    finally:
        await b.close()


@pytest.mark.parametrize("batches", ["one batch", "a batch each"])
async def test_a_task_whose_last_record_is_unreadable_is_quarantined_not_restored_from_an_older_one(
        tmp_path: Path, batches: str) -> None:
    """A DEAD, published task whose last record this release cannot read (a newer release wrote it) came back
    from its earlier record PENDING, and could be dead-lettered twice. It is quarantined: not in the store, not
    runnable, counted; a later record it can read ends the quarantine."""
    store, local = await scoped_store(tmp_path / "a")
    task = on("src", 0, 1)
    first = (await _logged_records(store, local, task))[task.id]
    await store.close()
    newer = {**first, "schema": "rdq.task/v3", "version": 4,
             "task": {**first["task"], "status": "DEAD", "next_attempt_at": None, "dlq_state": "PUBLISHED"}}
    log = [(0, task.id.encode(), json.dumps(first).encode()), (1, task.id.encode(), json.dumps(newer).encode())]
    b, b_local = await scoped_store(tmp_path / "b")
    try:
        await b_local.restore_begin(HOME)
        for part in ([log] if batches == "one batch" else [[r] for r in log]):
            await b_local.restore_batch(HOME, "cl", part, T0, [])
        assert await b_local.restore_finish(HOME) == 0
        assert await b.get(task.id) is None  # not PENDING again
        assert await b_local.quarantined_counts() == {"cl/0": 1}
        assert await b.claim_due("q", 10, 30, "w", T0 + 10) == []
        # Its next record, readable (the newer release was rolled back and the task moved on): restored.
        later = {**first, "version": 5}
        await b_local.restore_batch(HOME, "cl", [(2, task.id.encode(), json.dumps(later).encode())], T0, [])
        restored = await b.get(task.id)
        assert restored is not None and restored.status == Status.PENDING
        assert await b_local.quarantined_counts() == {}
    finally:
        await b.close()


async def test_the_record_schema_says_what_its_reader_must_know(tmp_path: Path) -> None:
    """rdq.task/v2 for a task of an ordered queue (PARKED, order_*), rdq.task/v1 for the others: a bridge rolled
    back to a release before ordering reads the others and quarantines those. This release reads both."""
    import dataclasses

    from bridge.model import order_key_of

    store, local = await scoped_store(tmp_path)
    try:
        plain = on("src", 0, 1)
        ordered = dataclasses.replace(on("src", 0, 2), order_key=order_key_of("src", 0, b"k"), order_seq=2)
        records = await _logged_records(store, local, plain, ordered)
        assert records[plain.id]["schema"] == "rdq.task/v1" and records[ordered.id]["schema"] == "rdq.task/v2"
        assert decode(ordered.id.encode(), json.dumps(records[ordered.id]).encode()).task["order_seq"] == 2
    finally:
        await store.close()


def _random_text(rng: random.Random, n: int = 12) -> str:
    alphabet = 'az09 "\\/\n\t\r\x00\x01\x1f\x7f<>&é中😀\u2028\ufeff'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, n)))


def _maybe(rng: random.Random, value: Any) -> Any:
    return value if rng.random() < 0.6 else None


def _random_row(rng: random.Random, i: int) -> dict[str, Any]:
    status = rng.choice(["PENDING", "IN_FLIGHT", "SUCCEEDED", "DEAD", "PARKED"])
    ordered = status == "PARKED" or rng.random() < 0.2
    big = rng.choice([0, 1, 2**31, 2**53 + 1, 2**63 - 1, -5])
    return {
        "id": f"T{i:05d}{_random_text(rng, 4)}", "queue": _random_text(rng) or "q",
        "handler_ref": "h" + _random_text(rng),
        "handler_version": _maybe(rng, _random_text(rng)), "payload": rng.randbytes(rng.choice([0, 1, 2, 3, 57, 4000])),
        "payload_content_type": _random_text(rng),
        "headers": json.dumps({_random_text(rng, 6): _random_text(rng) for _ in range(rng.randint(0, 4))}),
        "status": status, "attempt_count": rng.randint(0, 9), "redrive_count": rng.randint(0, 3),
        "next_attempt_at": None if status in ("SUCCEEDED", "DEAD", "PARKED") else T0 + rng.randint(-9, 9),
        "lease_expires_at": T0 if status == "IN_FLIGHT" else None, "lease_token": big,
        "lease_owner": _maybe(rng, _random_text(rng)), "lease_started_at": _maybe(rng, T0),
        "created_at": T0 - i, "life_started_at": T0, "finished_at": _maybe(rng, T0 + 1), "fetched_at": _maybe(rng, big),
        "dead_reason_type": _maybe(rng, _random_text(rng)), "dead_reason_message": _maybe(rng, _random_text(rng, 40)),
        "dlq_state": rng.choice([None, "PENDING", "PUBLISHED"]), "dlq_topic": _maybe(rng, _random_text(rng)),
        "dlq_partition": _maybe(rng, rng.randint(0, 99)), "dlq_offset": _maybe(rng, big),
        "home_topic": "src", "home_partition": 0, "version": rng.randint(1, 50), "logged_version": 0,
        "order_key": f"src/0/{_random_text(rng, 5)}" if ordered else None, "order_seq": i if ordered else None,
        "order_hold": rng.randint(0, 1),
    }


def _insert_random(conn: Any, rng: random.Random, rows: list[dict[str, Any]]) -> None:
    """The random rows as tasks, each with random attempts (inserted out of order) and redrives."""
    for row in rows:
        conn.execute(f"INSERT INTO tasks ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                     list(row.values()))
        for seq in rng.sample(range(1, 30), rng.randint(0, 5)):  # out of order: the query orders them
            conn.execute("INSERT INTO attempts VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", (
                row["id"], seq, rng.randint(1, 5), rng.randint(0, 2), T0, T0 + 1,
                rng.choice(["SUCCESS", "RETRYABLE_FAILURE", "PERMANENT_FAILURE", "LEASE_EXPIRED"]),
                _maybe(rng, _random_text(rng)), _maybe(rng, _random_text(rng, 60)),
                _maybe(rng, _random_text(rng, 80)), _maybe(rng, _random_text(rng)),
                _maybe(rng, rng.randint(1, 5)), _maybe(rng, _random_text(rng))))
        for no in rng.sample(range(1, 9), rng.randint(0, 2)):
            conn.execute("INSERT INTO redrives VALUES (?,?,?,?,?,?)", (
                row["id"], no, T0 + no, _maybe(rng, _random_text(rng)), _maybe(rng, _random_text(rng)),
                _maybe(rng, _random_text(rng))))


async def test_the_records_sqlite_builds_are_the_ones_the_codec_encodes(tmp_path: Path) -> None:
    """The outbox's records are built by SQLite (queries.sql, changelog_outbox_records), the one-task path's by
    codec.encode: on 600 random tasks (binary payloads, control and non-BMP characters, big integers, NULLs,
    ordered ones, attempts with notes, redrives), the two parse to the same JSON and decode the same."""
    from bridge.store.queries import q

    rng = random.Random(20261202)
    rows = [_random_row(rng, i) for i in range(600)]
    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)

        await store.db.write(lambda conn: _insert_random(conn, rng, rows))
        built = {e.task_id: e for e in await local.outbox(1000)}
        assert len(built) == len(rows)
        for row in rows:
            one = await store.db.read(
                lambda c, i=row["id"]: LocalIndex._entry(c, c.execute(q("get_task"), {"id": i}).fetchone()))
            entry = built[row["id"]]
            assert (entry.home, entry.version) == (one.home, one.version)
            assert orjson.loads(entry.value or b"") == orjson.loads(one.value or b""), row["id"]
            assert decode(row["id"].encode(), entry.value or b"") == decode(row["id"].encode(), one.value or b"")
    finally:
        await store.close()


async def test_a_restore_puts_back_every_field_its_records_hold(tmp_path: Path) -> None:
    """The restore binds many rows a statement by position: on 600 random tasks (every field, NULLs, binary
    payloads, attempts with notes, redrives), each restored task is encoded again into a record that decodes as
    its own did, is logged at its version, and keeps the source reference its headers give."""
    from bridge.store.queries import q

    rng = random.Random(20261203)
    rows = [_random_row(rng, i) for i in range(600)]
    a, a_local = await scoped_store(tmp_path / "a")
    b, b_local = await scoped_store(tmp_path / "b")
    try:
        await a.db.write(lambda conn: _insert_random(conn, rng, rows))
        await a_local.set_home(HOME, HomeState.ACTIVE)
        records = [(i, e.task_id.encode(), e.value) for i, e in enumerate(await a_local.outbox(1000))]
        assert len(records) == len(rows)
        await b_local.restore_begin(HOME)
        for start in range(0, len(records), 250):
            applied = await b_local.restore_batch(HOME, "cl", records[start : start + 250], T0, [])
            assert applied.unreadable == 0
        for _, key, value in records:
            task_id = key.decode()
            again = await b.db.read(
                lambda c, i=task_id: LocalIndex._entry(c, c.execute(q("get_task"), {"id": i}).fetchone()))
            restored = decode(key, value or b"")
            assert decode(key, again.value or b"") == restored, key  # decoded: the codec's defaults applied
            row = await b.db.read(lambda c, i=task_id: c.execute(
                "SELECT version, logged_version, source_ref FROM tasks WHERE id = ?", (i,)).fetchone())
            assert tuple(row) == (restored.version, restored.version, restored.task["source_ref"])
    finally:
        await a.close()
        await b.close()


async def test_a_mark_never_takes_a_logged_version_back_and_marks_only_what_it_names(tmp_path: Path) -> None:
    """mark_logged is one statement for the whole round: a task named twice counts its higher version, an older
    acknowledgement after a newer one changes nothing, a task not named stays in the outbox."""

    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        tasks = [on("src", 0, i) for i in range(3)]
        for task in tasks:
            await store.submit(task)
        for _ in range(2):
            await store.claim_due("q", 1, 30, "w", T0)  # version 2
        by_id = {e.task_id: e for e in await local.outbox(10)}
        first, second = by_id[tasks[0].id], by_id[tasks[1].id]
        assert first.version == second.version == 2
        older = Entry(first.task_id, first.home, 1, first.value)
        # Each task twice, the older first for one and last for the other: the higher counts either way.
        await local.mark_logged([older, first, second, Entry(second.task_id, second.home, 1, second.value)])
        assert {e.task_id for e in await local.outbox(10)} == {tasks[2].id}  # not named: still to log
        await local.mark_logged([older])  # late and older: the logged version stays 2
        assert {e.task_id for e in await local.outbox(10)} == {tasks[2].id}
    finally:
        await store.close()


async def test_a_state_sent_is_held_from_the_outbox_until_a_read_sees_its_mark() -> None:
    """The writer does not wait for its marks (bridge/changelog/holds.py): until a read begun after the mark
    committed, the state sent — or an older one, a DEAD task's before its "published" record — is not read again;
    a newer state is; a hold superseded by a newer send stays until that one's mark."""
    from bridge.changelog.holds import Holds

    def entry(task: str, version: int) -> Entry:
        return Entry(task, HOME, version, b"{}")

    loop = asyncio.get_running_loop()
    holds, first, second = Holds(), loop.create_future(), loop.create_future()
    holds.sent([entry("t", 3)], first)
    holds.before_read()
    assert holds.unsent([entry("t", 3), entry("t", 2), entry("u", 1), entry("t", 4)]) == [entry("u", 1),
                                                                                        entry("t", 4)]
    first.set_result(None)
    assert holds.unsent([entry("t", 3)]) == []  # committed, but this read may have begun before: still held
    holds.before_read()
    assert holds.unsent([entry("t", 3)]) == [entry("t", 3)]
    holds.sent([entry("t", 3)], loop.create_future())
    holds.sent([entry("t", 5)], second)
    holds._marks[0][0].set_result(None)
    holds.before_read()
    assert holds.unsent([entry("t", 4)]) == []  # the send of 5 still waits for its mark
    second.set_exception(RuntimeError("disk full"))  # a failed mark: sent again, the same state
    await holds.settled()
    assert holds.unsent([entry("t", 5)]) == [entry("t", 5)]


class _PausedIndex(LocalIndex):
    """The real index, whose outbox reads pause (their SQLite read done) until `gate` is set."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.reading, self.gate = asyncio.Event(), asyncio.Event()

    async def outbox(self, *args: Any, **kwargs: Any) -> list[Entry]:
        entries = await super().outbox(*args, **kwargs)
        self.reading.set()
        await self.gate.wait()
        return entries


async def test_a_hold_released_during_a_read_still_filters_that_read(tmp_path: Path) -> None:
    """A DEAD task's "published" state is sent and held; a round's read begins before the mark of the state before
    it commits, and a flush's `settled` releases the hold while that read runs: the read's stale unpublished state
    is still dropped. Sent after the published one, it was the changelog's last word, and the next owner, restoring
    it, dead-lettered the task again (the rolling restart's DLQ duplicates, one run in ten)."""
    from bridge.changelog.holds import Holds

    store = await Store.open(tmp_path / "rdq.db", scoped=True)
    local = _PausedIndex(store)
    await local.set_changelogged(["src"])
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        task = on("src", 0, 1)
        await store.submit(task)
        local.gate.set()
        [dead] = await local.outbox(10)  # the state before the publish (version 1 here), not logged yet
        local.gate.clear()
        holds, mark = Holds(), asyncio.get_running_loop().create_future()
        holds.sent([Entry(task.id, HOME, dead.version + 1, b"{}")], mark)  # the published state, in the changelog
        reading = asyncio.ensure_future(holds.read(local, 10, skip=[]))
        await local.reading.wait()  # its snapshot: the state before the publish, unlogged
        await local.mark_logged([dead])
        mark.set_result(None)
        await holds.settled()  # a flush, meanwhile: the hold goes
        local.gate.set()
        entries, _ = await reading
        assert [(e.task_id, e.version) for e in entries] == []
    finally:
        await store.close()


async def test_a_round_reads_past_what_it_holds_without_building_it(tmp_path: Path) -> None:
    """A round's read leaves out, in SQLite, the states sent whose marks are not committed and the tasks it was
    told to skip: built and dropped after the read, they were nearly half of its work on the failure path (and,
    past its limit, they took the places of states still to send). A newer state of a task held is read."""
    from bridge.changelog.holds import Holds

    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        # In the order of their ids and writes: the held state is the first a read meets.
        held, other, skipped = sorted((on("src", 0, i) for i in range(3)), key=lambda t: t.id)
        for task in (held, other, skipped):
            await store.submit(task)
        by_id = {e.task_id: e for e in await local.outbox(10)}
        holds = Holds()
        holds.sent([by_id[held.id]], asyncio.get_running_loop().create_future())  # its mark not committed
        entries, idle = await holds.read(local, 1, skip=[])  # the held state, first in the store, is passed over
        assert [e.task_id for e in entries] == [other.id] and not idle
        entries, _ = await holds.read(local, 10, skip=[skipped.id])
        assert [e.task_id for e in entries] == [other.id]
        await local.mark_logged([by_id[other.id], by_id[skipped.id]])
        entries, idle = await holds.read(local, 10, skip=[])
        assert entries == [] and not idle  # only the held state is unlogged: not idle while it is held
        await store.claim_due("q", 10, 30, "w", T0)  # a newer state of the held task: read
        entries, _ = await holds.read(local, 10, skip=[])
        assert {(e.task_id, e.version) for e in entries} >= {(held.id, 2)}
    finally:
        await store.close()


async def test_a_round_reads_a_bounded_number_of_bytes_and_the_next_rounds_the_rest(tmp_path: Path) -> None:
    """A backlog of large tasks is read a round's bytes at a time, not 5,000 tasks at once (a record may be 8 MiB:
    tens of gigabytes, read again at every restart); the next reads take the rest, each state once."""
    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        large = [type(t)(**{**t.__dict__, "payload": bytes([i]) * 1_000_000})
                 for i, t in enumerate(on("src", 0, i) for i in range(12))]
        for task in large:
            await store.submit(task)
        rounds: list[list[int]] = []  # the sizes of each read's records
        read: list[str] = []
        while entries := await local.outbox(5000, max_bytes=4_000_000):
            rounds.append([len(e.value or b"") for e in entries])
            read += [e.task_id for e in entries]
            await local.mark_logged(entries)
        assert len(rounds) == 4  # 1.33 MB records (base64): three a read, the last past the bound
        assert all(sum(sizes[:-1]) < 4_000_000 <= sum(sizes) for sizes in rounds)
        assert sorted(read) == sorted(t.id for t in large)  # each once, none left behind
    finally:
        await store.close()


async def test_the_premigration_reads_a_bounded_number_of_bytes_and_each_task_once(tmp_path: Path) -> None:
    """A file from before the changelog is written to it at the first start a bounded read at a time, as a round
    is: its large tasks were read 5,000 at once (gigabytes, again at every start until written)."""
    store, local = await scoped_store(tmp_path)
    try:
        large = [type(t)(**{**t.__dict__, "payload": bytes([i]) * 1_000_000})
                 for i, t in enumerate(on("src", i % 3, i) for i in range(12))]
        for task in large:
            await store.submit(task)
        await store.db.write(lambda c: c.execute("UPDATE tasks SET logged_version = -1"))  # as migration 0005 left them
        reads: list[list[int]] = []
        read: list[str] = []
        while entries := await local.premigration(5000, max_bytes=4_000_000):
            reads.append([len(e.value or b"") for e in entries])
            read += [e.task_id for e in entries]
            await local.mark_logged(entries)
        assert len(reads) == 4 and all(sum(sizes[:-1]) < 4_000_000 <= sum(sizes) for sizes in reads)
        assert sorted(read) == sorted(t.id for t in large)
    finally:
        await store.close()


class _CountingIndex(LocalIndex):
    """The real index; how many task ids the waiters asked the store about."""

    asked = 0

    async def unlogged(self, ids: Any) -> set[str]:
        ids = list(ids)
        self.asked += len(ids)
        return await super().unlogged(ids)


async def test_the_logged_waiters_ask_the_store_only_where_a_round_cannot_tell(tmp_path: Path) -> None:
    """A round resolves the tasks it logged; the store is asked about a task newly waited for that a round already
    resolved may have logged (its read ended after the task was written), and again only while it was held when
    asked (sent, its mark not committed: the mark ends its wait, not a round). Not every waiting task every round
    (thousands behind a backlog), yet nothing is left waiting: a task that leaves the store outside the rounds is
    found by the full ask of an idle round or, in a backlog, of the periodic one."""
    from bridge.changelog.holds import Holds
    from bridge.changelog.waiters import LoggedWaiters

    store = await Store.open(tmp_path / "rdq.db", scoped=True)
    local = _CountingIndex(store)
    await local.set_changelogged(["src"])
    now = [0.0]
    holds = Holds()
    waiters = LoggedWaiters(local, holds.holds, recheck=60.0, clock=lambda: now[0])
    resolved: list[str] = []
    busy = {"another-task"}  # a round that logged something: not an idle one
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        tasks = [on("src", 0, i) for i in range(7)]
        for task in tasks:
            await store.submit(task)
        by_id = {e.task_id: e for e in await local.outbox(10)}
        await waiters.resolve(busy, read_ended=10.0)
        logged_before = tasks[0]
        await local.mark_logged([by_id[logged_before.id]])  # logged by a round before anyone waited for it
        for task in tasks[:5]:  # written before that round's read ended: a round may have logged them
            waiters.add(task.id, lambda i=task.id: resolved.append(i), written_since=9.0)  # type: ignore[misc]
        for task in tasks[5:]:  # written after it: no round resolved so far can have logged them
            waiters.add(task.id, lambda i=task.id: resolved.append(i), written_since=11.0)  # type: ignore[misc]
        await waiters.resolve({tasks[1].id}, read_ended=12.0)  # this round logged tasks[1]; 0, 2, 3, 4 asked
        assert set(resolved) == {tasks[1].id, logged_before.id} and local.asked == 4
        for _ in range(10):  # busy rounds that log none of those left: they are not asked about again
            await waiters.resolve(busy, read_ended=13.0)
        assert local.asked == 4 and len(resolved) == 2
        await waiters.resolve({tasks[5].id, tasks[6].id}, read_ended=14.0)
        assert set(resolved[2:]) == {tasks[5].id, tasks[6].id} and local.asked == 4

        # tasks[2] is sent while nobody asks; then a new waiter for it is asked about while it is held.
        mark = asyncio.get_running_loop().create_future()
        holds.sent([by_id[tasks[2].id]], mark)
        waiters.add(tasks[2].id, lambda: resolved.append("again"))
        await waiters.resolve(busy, read_ended=15.0)  # held, its mark not committed: unlogged, asked again
        assert len(resolved) == 4
        await local.mark_logged([by_id[tasks[2].id]])
        mark.set_result(None)
        holds.before_read()
        await waiters.resolve(busy, read_ended=16.0)
        assert resolved[4:] == [tasks[2].id, "again"]  # asked again, not left for the full ask

        # tasks[3] and [4] leave the store outside the rounds (their partition dropped): found by a full ask.
        await local.drop_home(HOME)
        await waiters.resolve(busy, read_ended=17.0)
        assert len(resolved) == 6
        now[0] = 61.0  # in a backlog: the periodic one
        await waiters.resolve(busy, read_ended=18.0)
        assert set(resolved[6:]) == {tasks[3].id, tasks[4].id} and not waiters._waiting

        gone = on("src", 0, 99)  # never stored (a redelivered record's task is the one stored before it)
        waiters.add(gone.id, lambda: resolved.append(gone.id), written_since=20.0)
        await waiters.resolve(busy, read_ended=21.0)
        assert resolved[-1] != gone.id
        await waiters.resolve(set(), read_ended=22.0)  # a round with nothing to send but held states: not idle
        assert resolved[-1] != gone.id
        await waiters.resolve(set(), read_ended=23.0, idle=True)  # an idle one asks about every task waiting
        assert resolved[-1] == gone.id
    finally:
        await store.close()
