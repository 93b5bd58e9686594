"""One test per transition of the task lifecycle (seed 004 status machine, seed 000 timers), on real files."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.model import Attempt, ErrorInfo, NewTask, Outcome, Status, error_type_matches, order_key_of
from bridge.store.bulk import ATTEMPT_COLUMNS, NEW_TASK_COLUMNS, attempt_row, task_row
from bridge.store.database import StoreError
from bridge.store.queries import migrations
from bridge.store.tasks import Store
from tests.helpers import T0, failure, plan_of, report

LEASE = 30.0


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = await Store.open(tmp_path / "rdq.db")
    yield s
    await s.close()


async def claim_one(store: Store, now: int = T0, queue: str = "q") -> tuple[str, int]:
    [task] = await store.claim_due(queue, 10, LEASE, "w1", now)
    return task.id, task.lease_token


async def test_store_is_wal_with_full_sync_by_default(store: Store) -> None:
    conn = sqlite3.connect(store.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert await store.db.in_thread(lambda: store.db.conn.execute("PRAGMA synchronous").fetchone()[0]) == 2  # FULL
    assert await store.schema_version() == len(migrations()) >= 2


async def test_nulls_and_blobs_are_bound_without_the_adapter_lookup_and_read_back_as_they_were(store: Store) -> None:
    """The store registers identity adapters for None and bytes (`bind_without_adapting`: the sqlite3 module's
    lookup for every NULL and blob was a large share of a restore's store time). What is stored does not change:
    NULL stays NULL, an empty payload stays an empty blob (not NULL), binary bytes come back byte for byte."""
    protocol = sqlite3.PrepareProtocol
    assert (type(None), protocol) in sqlite3.adapters and (bytes, protocol) in sqlite3.adapters
    payloads = [b"", bytes(range(256)), b"\x00" * 3]
    ids = []
    for payload in payloads:
        ids.append(await store.submit(failure(payload=payload)))
    for task_id, payload in zip(ids, payloads, strict=True):
        task = await store.get(task_id)
        assert task is not None and task.payload == payload and type(task.payload) is bytes
        assert task.handler_version is None and task.lease_owner is None and task.finished_at is None
    kinds = await store.db.read(lambda c: c.execute(
        "SELECT typeof(payload), typeof(handler_version), typeof(lease_owner) FROM tasks ORDER BY rowid").fetchall())
    assert [tuple(k) for k in kinds] == [("blob", "null", "null")] * 3


def test_a_task_id_is_a_ulid_of_its_millisecond_and_random_bits() -> None:
    """Task ids are written by a table, not by python-ulid: python-ulid must read each as a ULID of the moment it was
    made, its time part as python-ulid writes that millisecond, none twice, the random part's characters all used."""
    import time

    from ulid import ULID

    from bridge.model import new_task_id, ulid_time

    before = time.time_ns() // 1_000_000
    ids = [new_task_id() for _ in range(20_000)]
    after = time.time_ns() // 1_000_000
    assert len(set(ids)) == len(ids)
    assert all(str(ULID.from_str(i)) == i and before <= ULID.from_str(i).milliseconds <= after for i in ids)
    assert set("".join(i[10:] for i in ids)) == set("0123456789ABCDEFGHJKMNPQRSTVWXYZ")
    first = new_task_id()
    time.sleep(0.005)
    assert ULID.from_str(new_task_id()).milliseconds > ULID.from_str(first).milliseconds  # the time part moves on
    rng = random.Random(7)
    for ms in [0, 1, 31, 32, 2**48 - 1, *(rng.randrange(2**48) for _ in range(1000))]:
        assert ulid_time(ms) == str(ULID.from_bytes(ms.to_bytes(6, "big") + bytes(10)))[:10], ms


async def test_headers_of_any_text_are_stored_and_read_back_as_they_were(store: Store) -> None:
    """A task's headers are written by orjson, and by json where orjson refuses the text (a lone surrogate, which a
    header decoded with surrogateescape can hold): stored alone, or in a bulk insert with others, nothing is lost."""
    odd = {"é": "ü\u2028", "bad": "x\udcff", "": ""}
    alone = dataclasses.replace(failure(), headers=odd)
    in_bulk = [dataclasses.replace(failure(), headers={**odd, "rdq.source": f"kafka://in/0/{i}"})
               for i in range(3)]
    await store.submit(alone)
    await asyncio.gather(*(store.submit(t) for t in in_bulk))
    for task in (alone, *in_bulk):
        got = await store.get(task.id)
        assert got is not None and got.headers == task.headers


async def test_submit_retryable_first_delivery_is_pending_with_attempt_one(store: Store) -> None:
    task_id = await store.submit(failure(due_in_ms=100))
    task = await store.get(task_id)
    assert task is not None and task.status == Status.PENDING
    assert task.attempt_count == 1 and task.next_attempt_at == T0 + 100 and task.lease_expires_at is None
    assert [a.outcome for a in task.attempts] == [Outcome.RETRYABLE_FAILURE]
    assert task.headers["rdq.source"].startswith("kafka://t/0/") and len(task.id) == 26  # ULID


async def test_submit_permanent_first_delivery_is_dead_and_in_the_outbox(store: Store) -> None:
    task_id = await store.submit(failure(dead=ErrorInfo("bridge.handler_api.Permanent", "bad")))
    task = await store.get(task_id)
    assert task is not None and task.status == Status.DEAD and task.next_attempt_at is None
    assert task.dead_reason == ErrorInfo("bridge.handler_api.Permanent", "bad")
    assert [t.id for t in await store.dlq_outbox()] == [task_id]


async def test_claim_moves_due_pending_to_in_flight_with_lease_and_token(store: Store) -> None:
    due = await store.submit(failure())
    await store.submit(failure(due_in_ms=60_000))  # not due
    await store.submit(failure(queue="other"))  # other queue
    claimed = await store.claim_due("q", 10, LEASE, "w1", T0)
    assert [t.id for t in claimed] == [due]
    task = claimed[0]
    assert task.status == Status.IN_FLIGHT and task.attempt_count == 2 and task.lease_token == 1
    assert task.lease_expires_at == T0 + 30_000 and task.lease_owner == "w1"
    assert await store.claim_due("q", 10, LEASE, "w2", T0) == []  # a held lease is invisible


async def test_claim_respects_limit_and_due_order(store: Store) -> None:
    ids = [await store.submit(failure(due_in_ms=-i)) for i in range(5)]
    claimed = await store.claim_due("q", 2, LEASE, "w1", T0)
    assert [t.id for t in claimed] == [ids[4], ids[3]]  # the longest overdue first


async def test_success_moves_in_flight_to_succeeded(store: Store) -> None:
    task_id = await store.submit(failure())
    _, token = await claim_one(store)
    result = await store.record_success(task_id, token, 2, report(Outcome.SUCCESS, T0 + 10))
    assert result.accepted and result.status == Status.SUCCEEDED and result.attempt_no == 2
    task = await store.get(task_id)
    assert task is not None and task.status == Status.SUCCEEDED and task.finished_at == T0 + 10
    assert task.next_attempt_at is None and task.lease_expires_at is None
    assert [a.outcome for a in task.attempts] == [Outcome.RETRYABLE_FAILURE, Outcome.SUCCESS]
    assert [a.attempt_no for a in task.attempts] == [1, 2]


async def test_retryable_failure_reschedules_in_flight_to_pending(store: Store) -> None:
    task_id = await store.submit(failure())
    _, token = await claim_one(store)
    result = await store.record_retry(task_id, token, report(Outcome.RETRYABLE_FAILURE), T0 + 500)
    assert result.accepted and result.status == Status.PENDING
    task = await store.get(task_id)
    assert task is not None and task.status == Status.PENDING and task.next_attempt_at == T0 + 500
    assert task.attempts[-1].error == ErrorInfo("builtins.RuntimeError", "boom")
    assert await store.claim_due("q", 1, LEASE, "w1", T0 + 499) == []
    assert len(await store.claim_due("q", 1, LEASE, "w1", T0 + 500)) == 1


async def test_permanent_or_exhausted_moves_in_flight_to_dead(store: Store) -> None:
    task_id = await store.submit(failure())
    _, token = await claim_one(store)
    reason = ErrorInfo("bridge.handler_api.Permanent", "no")
    result = await store.record_dead(task_id, token, report(Outcome.PERMANENT_FAILURE, error=reason), reason)
    assert result.accepted and result.status == Status.DEAD
    task = await store.get(task_id)
    assert task is not None and task.status == Status.DEAD and task.dead_reason == reason
    assert task.dlq_state == "PENDING"


async def test_stale_token_changes_nothing(store: Store) -> None:
    task_id = await store.submit(failure())
    _, token = await claim_one(store)
    before = await store.get(task_id)
    for result in (
        await store.record_retry(task_id, token + 1, report(Outcome.RETRYABLE_FAILURE), T0),
        await store.record_dead(task_id, token - 1, report(Outcome.PERMANENT_FAILURE), ErrorInfo("x")),
    ):
        assert not result.accepted
    assert not await store.extend_lease(task_id, token + 1, LEASE, T0)
    assert not await store.release(task_id, token + 1, T0)
    assert await store.get(task_id) == before


async def test_heartbeat_extends_a_live_lease_only(store: Store) -> None:
    task_id = await store.submit(failure())
    _, token = await claim_one(store)
    assert await store.extend_lease(task_id, token, LEASE, T0 + 20_000)
    assert (await store.get(task_id)).lease_expires_at == T0 + 50_000  # type: ignore[union-attr]
    assert not await store.extend_lease(task_id, token, LEASE, T0 + 50_000)  # lapsed: lost, not renewable


async def test_lapsed_lease_is_reclaimed_with_a_lease_expired_attempt(store: Store) -> None:
    task_id = await store.submit(failure())
    await claim_one(store)
    assert await store.lapsed_leases(T0 + 29_999) == []
    [lapsed] = await store.lapsed_leases(T0 + 30_000)
    assert await store.expire_lease(lapsed, T0 + 30_000, next_attempt_at=T0 + 30_100)
    task = await store.get(task_id)
    assert task is not None and task.status == Status.PENDING and task.attempt_count == 2
    assert task.attempts[-1].outcome == Outcome.LEASE_EXPIRED and task.attempts[-1].attempt_no == 2
    assert task.attempts[-1].error is not None and task.attempts[-1].error.type == "rdq.LeaseExpired"
    assert not await store.expire_lease(lapsed, T0 + 30_000, None)  # a second reclaim of the same lease: refused


async def test_lapsed_lease_with_attempts_exhausted_goes_dead(store: Store) -> None:
    task_id = await store.submit(failure())
    await claim_one(store)
    [lapsed] = await store.lapsed_leases(T0 + 31_000)
    assert await store.expire_lease(lapsed, T0 + 31_000, next_attempt_at=None)
    task = await store.get(task_id)
    assert task is not None and task.status == Status.DEAD and task.dead_reason is not None
    assert task.dead_reason.type == "rdq.LeaseExpired"


async def test_late_success_wins_while_not_terminal(store: Store) -> None:
    """Seed 000: A's lease lapses, B claims; A's late success is accepted; B is then refused."""
    task_id = await store.submit(failure())
    _, token_a = await claim_one(store)
    [lapsed] = await store.lapsed_leases(T0 + 30_000)
    await store.expire_lease(lapsed, T0 + 30_000, T0 + 30_000)
    _, token_b = await claim_one(store, T0 + 30_000)
    late = await store.record_success(task_id, token_a, 2, report(Outcome.SUCCESS, T0 + 31_000))
    assert late.accepted and late.status == Status.SUCCEEDED
    assert not (await store.record_success(task_id, token_b, 3, report(Outcome.SUCCESS, T0 + 32_000))).accepted
    assert not await store.extend_lease(task_id, token_b, LEASE, T0 + 32_000)  # B's heartbeat: lease lost
    task = await store.get(task_id)
    assert task is not None and task.status == Status.SUCCEEDED and task.attempt_count == 3
    assert [(a.attempt_no, a.outcome, a.late_result_of) for a in task.attempts] == [
        (1, Outcome.RETRYABLE_FAILURE, None), (2, Outcome.LEASE_EXPIRED, None), (3, Outcome.SUCCESS, 2)]


async def test_late_success_on_a_requeued_pending_task(store: Store) -> None:
    task_id = await store.submit(failure())
    _, token = await claim_one(store)
    [lapsed] = await store.lapsed_leases(T0 + 30_000)
    await store.expire_lease(lapsed, T0 + 30_000, T0 + 60_000)
    result = await store.record_success(task_id, token, 2, report(Outcome.SUCCESS, T0 + 31_000))
    assert result.accepted and result.attempt_no == 3
    task = await store.get(task_id)
    assert task is not None and task.attempt_count == len(task.attempts) == 3


async def test_a_forged_token_finishes_nothing(store: Store) -> None:
    """Fencing: only a token really issued for the task (1..current) can carry a late success."""
    never_claimed = await store.submit(failure())
    for forged in (0, -1, 1, 2**40):
        result = await store.record_success(never_claimed, forged, 1, report(Outcome.SUCCESS))
        assert not result.accepted, forged
    task = await store.get(never_claimed)
    assert task is not None and task.status == Status.PENDING and len(task.attempts) == 1
    running = await store.submit(failure(queue="r"))
    _, token = await claim_one(store, queue="r")
    for forged in (0, token + 1, token + 1000):
        assert not (await store.record_success(running, forged, 2, report(Outcome.SUCCESS))).accepted, forged
    task = await store.get(running)
    assert task is not None and task.status == Status.IN_FLIGHT and task.lease_token == token
    assert (await store.record_success(running, token, 2, report(Outcome.SUCCESS))).accepted  # the holder's own


async def test_late_failure_is_discarded(store: Store) -> None:
    task_id = await store.submit(failure())
    _, token = await claim_one(store)
    [lapsed] = await store.lapsed_leases(T0 + 30_000)
    await store.expire_lease(lapsed, T0 + 30_000, T0 + 30_000)
    before = await store.get(task_id)
    assert not (await store.record_retry(task_id, token, report(Outcome.RETRYABLE_FAILURE), T0)).accepted
    assert not (await store.record_dead(task_id, token, report(Outcome.PERMANENT_FAILURE), ErrorInfo("x"))).accepted
    assert await store.get(task_id) == before


async def test_nothing_is_finished_twice(store: Store) -> None:
    task_id = await store.submit(failure())
    _, token = await claim_one(store)
    assert (await store.record_success(task_id, token, 2, report(Outcome.SUCCESS))).accepted
    assert not (await store.record_success(task_id, token, 2, report(Outcome.SUCCESS))).accepted
    assert len((await store.get(task_id)).attempts) == 2  # type: ignore[union-attr]


async def test_queue_timeout_from_pending_and_in_flight(store: Store) -> None:
    pending = await store.submit(failure(due_in_ms=10**9))
    running = await store.submit(failure())
    _, token = await claim_one(store)
    assert await store.time_out("q", T0 + 1, T0 + 3_600_000, "queue_timeout of 3600s exceeded") == 2
    for task_id in (pending, running):
        task = await store.get(task_id)
        assert task is not None and task.status == Status.DEAD and task.dead_reason is not None
        assert task.dead_reason.type == "rdq.Timeout"
    ran = await store.get(running)
    assert ran is not None and ran.attempts[-1].outcome == Outcome.LEASE_EXPIRED
    assert ran.attempt_count == len(ran.attempts)
    # A late result after the timeout is refused: the verdict is final.
    assert not (await store.record_success(running, token, 2, report(Outcome.SUCCESS))).accepted


async def test_queue_timeout_spares_young_tasks(store: Store) -> None:
    await store.submit(failure(now=T0 + 10))
    assert await store.time_out("q", T0 + 10, T0 + 20, "x") == 0


async def test_redrive_moves_dead_to_pending_keeping_history(store: Store) -> None:
    task_id = await store.submit(failure(dead=ErrorInfo("bridge.handler_api.Permanent", "no")))
    assert await store.redrive(task_id, T0 + 1000, by="sre@example", request_id="r1")
    task = await store.get(task_id)
    assert task is not None and task.status == Status.PENDING and task.attempt_count == 0
    assert task.redrive_count == 1 and task.next_attempt_at == T0 + 1000 and task.life_started_at == T0 + 1000
    assert task.dead_reason is None and task.dlq_state is None and len(task.attempts) == 1
    assert await store.redrives(task_id) == [{"task_id": task_id, "redrive_no": 1, "at": T0 + 1000,
                                              "by": "sre@example", "request_id": "r1", "key_id": None}]
    assert not await store.redrive(task_id, T0, "x", "r2")  # only DEAD can be redriven
    [claimed] = await store.claim_due("q", 1, LEASE, "w1", T0 + 1000)
    assert claimed.attempt_count == 1 and claimed.redrive_count == 1


async def test_release_requeues_at_once_without_counting_an_attempt(store: Store) -> None:
    task_id = await store.submit(failure(due_in_ms=0))
    _, token = await claim_one(store)
    assert await store.release(task_id, token, T0 + 5)
    task = await store.get(task_id)
    assert task is not None and task.status == Status.PENDING and task.next_attempt_at == T0 + 5
    assert task.attempt_count == 1 == len(task.attempts)


async def test_succeeded_tasks_are_purged_after_ttl(store: Store) -> None:
    task_id = await store.submit(failure())
    _, token = await claim_one(store)
    await store.record_success(task_id, token, 2, report(Outcome.SUCCESS, T0))
    assert await store.purge("q", "finished", T0) == 0
    assert await store.purge("q", "finished", T0 + 1) == 1
    assert await store.get(task_id) is None
    history = "SELECT COUNT(*) FROM attempt_history"
    assert await store.db.in_thread(lambda: store.db.conn.execute(history).fetchone()[0]) == 0


async def test_the_dlq_outbox_skips_entries_on_their_way(store: Store) -> None:
    """The publisher asks for a batch past the entries it has sent and not yet marked: a full batch of new ones,
    none of the pending read again."""
    ids = [await store.submit(failure(dead=ErrorInfo("x", "y"))) for _ in range(5)]
    first = [t.id for t in await store.dlq_outbox(2)]
    assert len(first) == 2 and set(first) <= set(ids)
    rest = [t.id for t in await store.dlq_outbox(10, skip=first)]
    assert sorted(rest) == sorted(set(ids) - set(first))
    assert [t.id for t in await store.dlq_outbox(10, skip=ids)] == []


async def test_dead_tasks_are_purged_only_after_the_dlq_ack(store: Store) -> None:
    task_id = await store.submit(failure(dead=ErrorInfo("x", "y")))
    assert await store.purge("q", "finished", T0 + 10**9) == 0  # not yet published: never purged
    [task] = await store.dlq_outbox()
    assert task.id == task_id and len(task.attempts) == 1
    assert await store.mark_dlq_published(task, "q.dlq", 0, 42, T0 + 5)
    assert await store.dlq_outbox() == []
    assert await store.purge("q", "finished", T0 + 1) == 1


async def test_a_task_put_back_from_its_dlq_record_is_kept_for_its_retention_from_then(store: Store) -> None:
    """A DEAD task re-created from a DLQ record (a redrive after the purge, `rdq import` of an old DLQ) died long
    ago. Its retention counted from its death, the next sweep purged it again: between a redrive's re-creation and
    its redrive (test_admin's redrive from a DLQ record, in one CI run: re-created, never run), and for good after
    an import of records older than task_ttl. Under retain_from: fetched, its DLQ record (acknowledged already)
    counts as read when it came back: unread, it was kept for ever. Its death time stays (the --since/--until
    filters)."""
    task_id = await store.submit(failure(dead=ErrorInfo("x", "y")))
    [task] = await store.dlq_outbox()
    assert await store.mark_dlq_published(task, "q.dlq", 0, 42, T0 + 5)
    assert await store.purge("q", "finished", T0 + 1) == 1
    back = T0 + 10**9  # long past its death and any retention
    assert await store.recreate_dead(task, "q.dlq", 0, 42, back)
    again = await store.get(task_id)
    assert again is not None and again.status == Status.DEAD and again.finished_at == task.finished_at
    assert await store.purge("q", "finished", back) == 0
    assert await store.purge("q", "fetched", back) == 0  # its DLQ record, acknowledged, counts as read from then
    assert await store.dead_ids("q", until=T0 + 1) == [task_id]
    assert await store.purge("q", "fetched", back + 1) == 1
    assert await store.recreate_dead(task, "q.dlq", 0, 42, back)
    assert await store.purge("q", "finished", back + 1) == 1


async def test_retain_from_fetched_counts_from_the_first_read(store: Store) -> None:
    task_id = await store.submit(failure())
    _, token = await claim_one(store)
    await store.record_success(task_id, token, 2, report(Outcome.SUCCESS, T0))
    assert await store.purge("q", "fetched", T0 + 10**9) == 0  # unread: held indefinitely
    assert await store.mark_fetched(task_id, T0 + 100)
    assert not await store.mark_fetched(task_id, T0 + 200)  # the first read starts the clock
    assert await store.purge("q", "fetched", T0 + 100) == 0
    assert await store.purge("q", "fetched", T0 + 101) == 1


async def test_the_periodic_counts_read_no_more_than_they_need(store: Store) -> None:
    """Backpressure counts a queue's open tasks every 250 ms and the health probe its parked ones every 2 s: read
    whole, a million restored tasks were read four times a second and the table scanned every two (a restore of
    1M tasks under processes: 2 at 33-40k tasks/s with them, 44k without, bench_processes restore). The open
    count stops at the limit it is asked about; the parked stats read the index of ordered tasks only."""
    for _ in range(5):
        await store.submit(failure())
    assert await store.count_open("q", 3) == 3 and await store.count_open("q") == 5
    plan = await plan_of(store, "parked_oldest")
    assert any("tasks_order" in step for step in plan) and "SCAN tasks" not in plan, plan


async def test_counts_and_lists(store: Store) -> None:
    await store.submit(failure())
    await store.submit(failure(dead=ErrorInfo("rdq.Unroutable", "x")))
    await store.submit(failure(queue="other"))
    assert await store.counts() == {"q": {"PENDING": 1, "IN_FLIGHT": 0, "SUCCEEDED": 0, "DEAD": 1, "PARKED": 0},
                                    "other": {"PENDING": 1, "IN_FLIGHT": 0, "SUCCEEDED": 0, "DEAD": 0, "PARKED": 0}}
    assert await store.count_open("q") == 1
    assert len(await store.list_tasks(queue="q", status=Status.DEAD)) == 1
    assert len(await store.dead_ids("q", error_type="rdq.Unroutable")) == 1
    assert await store.dead_ids("q", error_type="rdq.Timeout") == []


async def test_redrive_filters_take_an_error_type_with_or_without_its_module(store: Store) -> None:
    """`rdq redrive --error-type TransientError` finds handlers.examples.TransientError (as the config's `errors`
    lists accept names); a qualified name matches only itself; a name is a whole class name, not a suffix."""
    transient = await store.submit(failure(dead=ErrorInfo("handlers.examples.TransientError", "x")))
    other = await store.submit(failure(dead=ErrorInfo("billing.TransientError", "x")))
    await store.submit(failure(dead=ErrorInfo("handlers.examples.VeryTransientError", "x")))
    await store.submit(failure(dead=ErrorInfo("TransientError_x", "x")))
    assert sorted(await store.dead_ids("q", error_type="TransientError")) == sorted([transient, other])
    assert await store.dead_ids("q", error_type="handlers.examples.TransientError") == [transient]
    assert await store.dead_ids("q", error_type="examples.TransientError") == []
    assert await store.dead_ids("q", error_type="Transient_rror") == []  # no LIKE wildcards
    # `rdq list --error-type` and `rdq import --error-type` match the same way.
    assert sorted(t.id for t in await store.list_tasks("q", error_type="TransientError")) == sorted([transient, other])
    assert [t.id for t in await store.list_tasks(error_type="handlers.examples.TransientError")] == [transient]
    assert await store.list_tasks(error_type="examples.TransientError") == []
    for stored in ("handlers.examples.TransientError", "billing.TransientError"):
        assert error_type_matches(stored, "TransientError")
    assert not error_type_matches("handlers.examples.VeryTransientError", "TransientError")
    assert not error_type_matches("handlers.examples.TransientError", "examples.TransientError")
    assert not error_type_matches(None, "TransientError")


async def test_concurrent_submits_are_group_committed(store: Store) -> None:
    ids = await asyncio.gather(*(store.submit(failure()) for _ in range(500)))
    assert len(set(ids)) == 500
    assert store.stats.batches < 50  # one fsync covers many callers
    assert (await store.counts())["q"]["PENDING"] == 500


def synchronous_level(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA synchronous").fetchone()[0])


async def test_a_group_commit_of_journal_writes_alone_is_not_fsynced_and_one_with_a_durable_write_is(
        store: Store) -> None:
    """The in-flight journal need survive the process, not the machine: at a few hundred records/s its write
    a poll was an fsync a record for records that succeed. A commit of such writes alone runs at NORMAL (the WAL
    written, not synced); any durable write in the batch makes the whole commit FULL."""
    db = store.db
    assert await db.write(synchronous_level, durable=False) == 1  # NORMAL
    assert await db.read(synchronous_level) == 2  # anything else on the writer's connection: FULL, as configured
    assert await db.write(synchronous_level, durable=False) == 1
    assert await db.write(synchronous_level) == 2  # FULL again for a durable write alone
    batches, synced = store.stats.batches, store.stats.synced
    shared = await asyncio.gather(db.write(synchronous_level, durable=False), store.submit(failure()))
    assert store.stats.batches == batches + 1, "both writes in one group commit"
    assert shared[0] == 2 and store.stats.synced == synced + 1  # the task's submit: fsync'd, the journal with it
    await store.journal_inflight("run-1", [("t", 0, 10, 20)], [("t", 0, 5)], T0)
    assert store.stats.batches == batches + 2 and store.stats.synced == synced + 1  # the journal alone: not
    assert await store.journal_suspects("run-2") == [("t", 0, 10, 20)]


async def test_a_failing_operation_does_not_undo_its_batch(store: Store) -> None:
    new = failure()
    await store.submit(new)
    twin = dataclasses.replace(failure(), id=new.id)  # same id, another source: a constraint violation
    results = await asyncio.gather(store.submit(failure()), store.submit(twin), store.submit(failure()),
                                   return_exceptions=True)
    assert isinstance(results[1], StoreError) and "UNIQUE" in str(results[1])
    assert all(isinstance(r, str) for r in (results[0], results[2]))
    assert (await store.counts())["q"]["PENDING"] == 3


async def test_a_redelivered_record_does_not_become_a_second_task(store: Store) -> None:
    first = failure()
    again = dataclasses.replace(failure(dead=ErrorInfo("x", "y")), headers=first.headers)
    await store.submit(first)
    await asyncio.gather(store.submit(again), store.submit(failure()))  # the bulk path too
    await store.submit(again)
    assert (await store.counts())["q"] == {"PENDING": 2, "IN_FLIGHT": 0, "SUCCEEDED": 0, "DEAD": 0, "PARKED": 0}
    assert await store.get(again.id) is None
    task = await store.get(first.id)
    assert task is not None and len(task.attempts) == 1
    other_time = dataclasses.replace(again, headers={**first.headers, "rdq.kafka.timestamp": "5"}, id="01OTHER")
    await store.submit(other_time)  # same offset, another record (a recreated topic): stored
    assert await store.get("01OTHER") is not None


async def test_reopen_keeps_everything_and_refuses_a_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "rdq.db"
    store = await Store.open(path)
    task_id = await store.submit(failure())
    await store.close()
    store = await Store.open(path)
    assert (await store.get(task_id)) is not None
    await store.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=99")
    conn.close()
    with pytest.raises(StoreError, match="newer than this rdq-bridge knows"):
        await Store.open(path)


async def test_unwritable_store_fails_with_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="cannot open"):
        await Store.open(tmp_path / "file" / "rdq.db")


async def test_a_store_written_by_schema_version_1_opens_and_migrates(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path, isolation_level=None)
    version, _, sql = migrations()[0]
    conn.executescript(f"BEGIN; {sql}; PRAGMA user_version={version}; COMMIT;")
    conn.execute("INSERT INTO tasks (id, queue, handler_ref, payload, payload_content_type, headers, status, "
                 "next_attempt_at, created_at, life_started_at) VALUES ('01OLD', 'q', 'ok', x'00', 'b', '{}', "
                 "'PENDING', 1, 1, 1)")
    conn.close()
    store = await Store.open(path)
    try:
        assert await store.schema_version() == len(migrations())
        task = await store.get("01OLD")
        assert task is not None and task.status == Status.PENDING
        assert await store.journal_suspects("run") == []
    finally:
        await store.close()


async def test_first_delivery_journal(store: Store) -> None:
    await store.journal_inflight("run-1", [("t", 0, 10, 20), ("t", 1, 5, 5)], [], T0)
    await store.journal_inflight("run-1", [("t", 0, 15, 30)], [], T0)  # one row per partition and run
    assert sorted(await store.journal_suspects("run-2")) == [("t", 0, 15, 30), ("t", 1, 5, 5)]
    assert await store.journal_suspects("run-1") == []
    await store.journal_inflight("run-2", [], [("t", 1, 6)], T0)  # committed past 5: pruned
    assert await store.journal_suspects("run-2") == [("t", 0, 15, 30)]
    await store.journal_forget_run("run-1")
    assert await store.journal_suspects("run-2") == []


async def test_one_unstorable_task_fails_alone_not_its_batch_nor_the_store(store: Store) -> None:
    """A value SQLite cannot hold (a due time past INTEGER) fails its own submit only: the others of the same
    group commit are stored and the store stays writable (it was: the whole batch failed, store unhealthy)."""
    good = [failure() for _ in range(5)]
    bad = failure(due_in_ms=2**70)
    results = await asyncio.gather(*(store.submit(t) for t in [*good[:2], bad, *good[2:]]), return_exceptions=True)
    assert store.stats.largest_batch >= 6  # they were one transaction
    assert isinstance(results[2], StoreError)
    assert [r for i, r in enumerate(results) if i != 2] == [t.id for t in good]
    assert store.writable
    assert [await store.get(t.id) is not None for t in good] == [True] * 5


async def test_a_revoked_partitions_journal_rows_are_pruned(store: Store, tmp_path: Path) -> None:
    """Rows of partitions now owned by another instance stayed for ever (this instance never commits past them)."""
    from bridge.clock import SystemClock
    from bridge.live_config import LiveConfig
    from bridge.source.consumer import SourceConsumer
    from tests.helpers import engine_config

    config = engine_config(str(tmp_path / "rdq.db"), q={"handler": "ok", "sources": ["t"]})
    consumer = SourceConsumer(config, LiveConfig(config), None, store, "run-now", SystemClock(),  # type: ignore[arg-type]
                              lambda: None)  # type: ignore[arg-type, return-value]
    await store.journal_inflight("run-old", [("t", 0, 10, 20), ("t", 1, 5, 9)], [], T0)
    await store.journal_inflight("run-now", [("t", 0, 21, 30)], [], T0)
    await consumer.journal.prune({("t", 0)})
    assert await store.journal_suspects("another-run") == [("t", 1, 5, 9)]


async def test_scans_do_not_hold_back_group_commits(store: Store) -> None:
    """`stats` counted the whole table on the connection that does group commits: every failure being stored
    waited behind it. Scans now run on a reader of their own: with that reader busy, writes still commit."""
    import threading

    busy = threading.Event()
    release = threading.Event()

    def hold(conn: sqlite3.Connection) -> None:
        busy.set()
        release.wait(10)

    assert store.db._reader is not None
    holding = asyncio.ensure_future(store.db._reader._execute(hold, store.db._reader._conn))
    await asyncio.to_thread(busy.wait, 5)
    counting = asyncio.ensure_future(store.counts())  # queued behind the held reader
    stored = await asyncio.wait_for(store.submit(failure()), 5)  # the writer is not held back
    assert await store.get(stored) is not None and not counting.done()
    release.set()
    await holding
    assert (await counting)["q"]["PENDING"] == 1


async def test_the_store_and_its_wal_and_shm_are_private_to_the_user(tmp_path: Path) -> None:
    """Payloads are the team's data: created under the default umask they were world-readable."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        store = await Store.open(tmp_path / "private" / "rdq.db")
        await store.submit(failure())
        files = [store.path, Path(f"{store.path}-wal"), Path(f"{store.path}-shm")]
        modes = {f.name: stat.S_IMODE(os.stat(f).st_mode) for f in files}
        await store.close()
    finally:
        os.umask(old)
    assert all(mode & 0o077 == 0 for mode in modes.values()), modes


async def _rows(store: Store, table: str, order: str) -> list[tuple[object, ...]]:
    return await store.db.read(lambda c: [tuple(r) for r in c.execute(f"SELECT * FROM {table} ORDER BY {order}")])


async def test_a_batch_stored_at_once_is_the_rows_one_by_one_would_be(tmp_path: Path) -> None:
    """The bulk insert (a chunk of rows in one statement, cut in chunks of 512, 256, ...) against the one-row
    statement each task falls back to: 1,100 random tasks, some dead, some with an order key (parked by their own
    rules), some a redelivered record of another in the batch, binary payloads, Unicode headers. Same rows."""
    rng = random.Random(25)
    tasks = []
    for i in range(1100):
        dead = rng.random() < 0.2
        task = failure(dead=ErrorInfo("x.Err", "\u00e9\x00" * rng.randrange(3)) if dead else None,
                       due_in_ms=rng.randrange(10_000), payload=rng.randbytes(rng.randrange(40)),
                       version=rng.choice([None, "v1", "\u2603"]))
        if tasks and rng.random() < 0.05:
            task = dataclasses.replace(task, headers=rng.choice(tasks).headers)  # redelivered: not stored twice
        elif rng.random() < 0.1:
            task = dataclasses.replace(task, headers={**task.headers, "rdq.source": f"kafka://t/{i % 3}/{i}"},
                                       order_key=order_key_of("t", i % 3, bytes([i % 7])), order_seq=i)
        elif rng.random() < 0.05:
            task = dataclasses.replace(task, headers={"h\u00fc": "\U0001f600"})  # no home, no source_ref
        tasks.append(task)
    at_once, one_by_one = await Store.open(tmp_path / "bulk.db"), await Store.open(tmp_path / "rows.db")
    try:
        assert await at_once.submit_many(tasks) == [None] * len(tasks)
        assert at_once.stats.largest_batch >= 1000  # the bulk path, not a commit a task
        for task in tasks:
            await one_by_one.submit(task)
        for table, order in [("tasks", "id"), ("attempts", "task_id, seq")]:
            bulk, rows = await _rows(at_once, table, order), await _rows(one_by_one, table, order)
            assert len(bulk) > 1000 and bulk == rows
    finally:
        await at_once.close()
        await one_by_one.close()


async def test_a_dlq_batch_reads_a_bounded_number_of_payload_bytes_and_the_next_the_rest(store: Store) -> None:
    """500 DEAD tasks of large payloads were read at once for a DLQ batch (gigabytes, read again after each
    restart); a batch now stops at about its bytes, and the reads after it, skipping what is on its way, take
    the rest, each once."""
    tasks = [dataclasses.replace(failure(dead=ErrorInfo("Permanent", "no"), now=T0 + i), payload=bytes([i]) * 1_000_000)
             for i in range(10)]
    assert await store.submit_many(tasks) == [None] * 10
    batches: list[list[str]] = []
    while entries := await store.dlq_outbox_entries(500, skip=[i for b in batches for i in b], max_bytes=3_000_000):
        batches.append([e.task.id for e in entries])
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert sorted(i for b in batches for i in b) == sorted(t.id for t in tasks)


@settings(max_examples=300, deadline=None)
@given(status=st.sampled_from([Status.PENDING, Status.DEAD]), attempt=st.booleans(), counted=st.booleans(),
       error=st.booleans(), source=st.sampled_from([None, "kafka://orders/3/17", "kafka://a/b/c", "file://x"]),
       timestamp=st.sampled_from([None, "1800000000000"]), note=st.sampled_from([None, "a note"]),
       version=st.sampled_from([None, "v2"]), late=st.sampled_from([None, 3]))
def test_a_new_task_row_is_its_params_in_the_bulk_insert_columns(
        status: Status, attempt: bool, counted: bool, error: bool, source: str | None, timestamp: str | None,
        note: str | None, version: str | None, late: int | None) -> None:
    """`task_row` and `attempt_row` write the values `params()` names out again, for speed: every field
    and branch of the two must agree, or the bulk insert stores other values than the one-by-one insert."""
    headers = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    if source is not None:
        headers["rdq.source"] = source
    if timestamp is not None:
        headers["rdq.kafka.timestamp"] = timestamp
    info = ErrorInfo("builtins.ValueError", "bad", "Traceback ...") if error else None
    first = Attempt(1, 0, T0, T0 + 5, Outcome.RETRYABLE_FAILURE, info, "w-1", late, note=note) if attempt else None
    dead = status == Status.DEAD
    task = NewTask(queue="q", handler_ref="h", payload=b"\x00p", headers=headers, status=status, created_at=T0,
                   first_attempt=first, next_attempt_at=None if dead else T0 + 1000,
                   dead_reason=ErrorInfo("rdq.Permanent", "no") if dead else None, handler_version=version,
                   first_attempt_counted=counted)
    params = task.params()
    assert task_row(task) == tuple(params[name] for name in NEW_TASK_COLUMNS)
    if first is not None:
        attempt_params = first.params(task.id)
        assert attempt_row(first, task.id) == tuple(attempt_params[name] for name in ATTEMPT_COLUMNS)


async def test_the_next_due_time_is_looked_for_no_further_than_asked(store: Store) -> None:
    """The claim loop asks when the next task is due only as far as it sleeps anyway (a second): looked for
    unbounded, with no task in its scope (every partition restoring), the question walked every pending task (209 ms
    at 500,000, every second of a restore)."""
    later = await store.submit(failure(now=T0))  # due at its next attempt, after T0
    due = (await store.get(later)).next_attempt_at  # type: ignore[union-attr]
    assert due is not None
    assert await store.next_due_at("q", until=due - 1) is None
    assert await store.next_due_at("q", until=due) == due and await store.next_due_at("q") == due
    plan = await plan_of(store, "next_due_at", queue="q", scoped=1, until=due)
    assert any("next_attempt_at<?" in step for step in plan), plan  # a range of the index, not all of it
