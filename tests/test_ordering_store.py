"""Per-key ordering in the store (SPEC §12): parking, release by the trigger, on_dead release | hold, skip, a
redriven head at the front, timeouts and back-pressure counting parked tasks. Real SQLite on disk."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import hypothesis
import pytest
from hypothesis import strategies as st

from bridge.model import ErrorInfo, NewTask, Outcome, Status, key_of_order_key, order_key_of
from bridge.store.tasks import Store
from tests.helpers import T0, failure, plan_of, report

LEASE = 30.0
KEY = order_key_of("t", 0, b"k")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = await Store.open(tmp_path / "rdq.db")
    yield s
    await s.close()


def head(offset: int, hold: bool = False, dead: bool = False, key: str | None = KEY) -> NewTask:
    task = failure(dead=ErrorInfo("rdq.Unroutable", "x") if dead else None)
    return dataclasses.replace(task, order_key=key, order_seq=offset, order_hold=hold)


def parked(offset: int, hold: bool = False, key: str | None = KEY, now: int = T0) -> NewTask:
    task = failure(now=now)
    return dataclasses.replace(task, status=Status.PARKED, next_attempt_at=None, first_attempt=None,
                               order_key=key, order_seq=offset, order_hold=hold)


async def status(store: Store, *ids: str) -> list[str]:
    return [str((await store.get(i)).status) for i in ids]  # type: ignore[union-attr]


async def run(store: Store, task_id: str, outcome: Outcome, now: int = T0 + 10) -> None:
    """Claim this task (it must be the only due one) and end its attempt."""
    [claimed] = await store.claim_due("q", 10, LEASE, "w1", now)
    assert claimed.id == task_id
    token, attempt = claimed.lease_token, claimed.attempt_count
    if outcome == Outcome.SUCCESS:
        assert (await store.record_success(task_id, token, attempt, report(outcome, now))).accepted
    else:
        assert (await store.record_dead(task_id, token, report(outcome, now), ErrorInfo("Boom", "no"))).accepted


async def test_records_behind_an_open_head_are_parked_and_released_one_at_a_time_in_order(store: Store) -> None:
    first = await store.submit(head(10))
    behind = [await store.submit(parked(offset)) for offset in (11, 12)]
    assert await status(store, first, *behind) == ["PENDING", "PARKED", "PARKED"]
    assert await store.count_open("q") == 3  # back-pressure counts parked tasks
    assert (await store.order_head(await store.get(behind[0])))["id"] == first  # type: ignore[arg-type,index]
    await run(store, first, Outcome.SUCCESS)
    assert await status(store, *behind) == ["PENDING", "PARKED"]  # offset 11 first
    task = await store.get(behind[0])
    assert task is not None and task.next_attempt_at == T0 + 10 and task.attempt_count == 0  # due at once
    await run(store, behind[0], Outcome.SUCCESS, T0 + 20)
    assert await status(store, behind[1]) == ["PENDING"]


async def test_a_parked_record_without_an_open_task_of_its_key_is_due_at_once(store: Store) -> None:
    lone = await store.submit(parked(5))
    other = await store.submit(head(6, key=order_key_of("t", 0, b"other")))
    assert await status(store, lone, other) == ["PENDING", "PENDING"]


async def test_a_dead_head_releases_its_key_or_holds_it_until_skipped(store: Store) -> None:
    released = await store.submit(head(1))
    after = await store.submit(parked(2))
    await run(store, released, Outcome.PERMANENT_FAILURE)
    assert await status(store, released, after) == ["DEAD", "PENDING"]  # on_dead: release

    await run(store, after, Outcome.SUCCESS, T0 + 11)
    key = order_key_of("t", 0, b"held")
    holding = await store.submit(head(1, hold=True, key=key))
    waiting = [await store.submit(parked(offset, hold=True, key=key)) for offset in (2, 3)]
    await run(store, holding, Outcome.PERMANENT_FAILURE, T0 + 12)
    assert await status(store, holding, *waiting) == ["DEAD", "PARKED", "PARKED"]  # on_dead: hold
    late = await store.submit(parked(4, hold=True, key=key))  # a new record of the held key parks too
    assert await status(store, late) == ["PARKED"]
    assert await store.skip(waiting[0]) is None  # only a dead head that holds can be skipped
    assert await store.skip(holding) == key
    assert await status(store, holding, *waiting, late) == ["DEAD", "PENDING", "PARKED", "PARKED"]
    assert await store.skip(holding) is None  # once


async def test_a_redriven_held_head_runs_first_then_releases_the_rest(store: Store) -> None:
    holding = await store.submit(head(1, hold=True))
    waiting = await store.submit(parked(2, hold=True))
    await run(store, holding, Outcome.PERMANENT_FAILURE)
    assert await store.redrive(holding, T0 + 20)
    assert await status(store, holding, waiting) == ["PENDING", "PARKED"]
    await run(store, holding, Outcome.SUCCESS, T0 + 30)
    assert await status(store, waiting) == ["PENDING"]


async def test_a_redriven_head_waits_at_the_front_of_its_key_behind_the_one_running(store: Store) -> None:
    first = await store.submit(head(1))
    second, third = await store.submit(parked(2)), await store.submit(parked(3))
    await run(store, first, Outcome.PERMANENT_FAILURE)  # release: the second runs
    assert await status(store, second, third) == ["PENDING", "PARKED"]
    assert await store.redrive(first, T0 + 15)
    assert await status(store, first) == ["PARKED"]  # not beside the second
    await run(store, second, Outcome.SUCCESS, T0 + 20)
    assert await status(store, first, third) == ["PENDING", "PARKED"]  # the redriven head goes first


async def test_a_parked_task_times_out_from_when_it_was_parked_and_the_key_moves_on(store: Store) -> None:
    first = await store.submit(head(1))
    stale = await store.submit(parked(2, now=T0 - 10_000))
    assert await store.time_out("q", T0 - 5_000, T0, "queue_timeout") == 1
    assert await status(store, first, stale) == ["PENDING", "DEAD"]
    task = await store.get(stale)
    assert task is not None and task.dead_reason is not None and task.dead_reason.type == "rdq.Timeout"


async def test_purging_a_held_dead_head_releases_its_key(store: Store) -> None:
    holding = await store.submit(head(1, hold=True, dead=True))
    waiting = await store.submit(parked(2, hold=True))
    assert await status(store, waiting) == ["PARKED"]
    task = await store.get(holding)
    assert task is not None
    await store.mark_dlq_published(task, "dlq", 0, 7, T0 + 1)  # a DEAD task is purged only once in its DLQ
    assert await store.purge_task(holding)
    assert await status(store, waiting) == ["PENDING"]


async def test_a_redelivered_record_older_than_its_keys_task_is_not_parked_again(store: Store) -> None:
    """After a crash, records are redelivered from the committed offset: one that ran (succeeded) before a later
    record of its key failed must not be parked behind that task (it would run again after it, out of order)."""
    later = await store.submit(head(10))
    ran_before = await store.submit(parked(5))
    assert await store.get(ran_before) is None and await status(store, later) == ["PENDING"]
    assert await status(store, await store.submit(parked(11))) == ["PARKED"]


@hypothesis.given(topic=st.from_regex(r"[a-zA-Z0-9._-]{1,40}", fullmatch=True), partition=st.integers(0, 10_000),
                  key=st.binary(max_size=64))
def test_an_ordering_key_gives_back_its_record_key(topic: str, partition: int, key: bytes) -> None:
    order_key = order_key_of(topic, partition, key)
    assert order_key is not None and key_of_order_key(order_key) == key


async def test_a_bulk_redrive_runs_a_keys_dead_records_in_offset_order(store: Store) -> None:
    """Bulk redrive took a queue's DEAD tasks oldest death first: the key's later record, dead before its earlier
    one was redriven alone and died again, went first and the earlier one parked behind it (SPEC §12 with §13)."""
    first = await store.submit(head(1))
    second = await store.submit(parked(2))
    await run(store, first, Outcome.PERMANENT_FAILURE, T0 + 10)  # on_dead release: the second runs
    await run(store, second, Outcome.PERMANENT_FAILURE, T0 + 11)
    assert await store.redrive(first, T0 + 12)
    await run(store, first, Outcome.PERMANENT_FAILURE, T0 + 13)  # now the first died last
    ids = await store.dead_ids("q")
    assert sorted(ids) == sorted([first, second])
    assert len(await store.redrive_many(ids, T0 + 14)) == 2
    assert await status(store, first, second) == ["PENDING", "PARKED"]
    await run(store, first, Outcome.SUCCESS, T0 + 15)
    assert await status(store, second) == ["PENDING"]


async def test_a_task_recreated_from_its_dlq_record_keeps_its_place_in_its_key(store: Store) -> None:
    """Redrive from a DLQ record after the store purged the task re-creates it: without its ordering fields it ran
    beside the record of its key running now."""
    first = await store.submit(head(1))
    second = await store.submit(parked(2))
    await run(store, first, Outcome.PERMANENT_FAILURE, T0 + 10)
    assert await status(store, second) == ["PENDING"]
    envelope = await store.get(first)
    assert envelope is not None
    await store.mark_dlq_published(envelope, "dlq", 0, 7, T0 + 11)
    assert await store.purge_task(first)
    assert await store.recreate_dead(envelope, "dlq", 0, 7, T0 + 11)
    recreated = await store.get(first)
    assert recreated is not None and (recreated.order_key, recreated.order_seq) == (KEY, 1)
    assert not recreated.order_hold  # its hold (if any) ended when its DLQ record was acknowledged and it purged
    assert await store.redrive(first, T0 + 12)
    assert await status(store, first, second) == ["PARKED", "PENDING"]
    await run(store, second, Outcome.SUCCESS, T0 + 13)
    assert await status(store, first) == ["PENDING"]


async def test_a_key_held_by_a_dead_record_is_not_released_by_another_of_its_records(store: Store) -> None:
    """on_dead: hold — a dead record that holds its key but is not its head (an earlier record was redriven, or a
    record behind it timed out) still holds it: the release trigger looked only for a running or due task."""
    holding = await store.submit(head(1, hold=True))
    stale = await store.submit(parked(2, now=T0 - 10_000))  # stored with on_dead release (a config change)
    waiting = await store.submit(parked(3, hold=True))
    await run(store, holding, Outcome.PERMANENT_FAILURE, T0 + 10)
    assert await status(store, holding, stale, waiting) == ["DEAD", "PARKED", "PARKED"]
    assert await store.time_out("q", T0 - 5_000, T0 + 11, "queue_timeout") == 1  # the stale one dies, releasing
    assert await status(store, stale, waiting) == ["DEAD", "PARKED"]  # … nothing: the key is held by the first
    assert await store.redrive(stale, T0 + 12)  # a later record redriven while an earlier one holds its key
    assert await status(store, stale, waiting) == ["PARKED", "PARKED"]
    assert await store.redrive(holding, T0 + 13)
    assert await status(store, holding) == ["PENDING"]
    await run(store, holding, Outcome.SUCCESS, T0 + 14)
    assert await status(store, stale, waiting) == ["PENDING", "PARKED"]  # in offset order
    await run(store, stale, Outcome.SUCCESS, T0 + 15)
    assert await status(store, waiting) == ["PENDING"]


async def test_a_failed_records_task_stored_after_an_earlier_one_was_redriven_parks_behind_it(store: Store) -> None:
    """A record ran inline and failed while an earlier record of its key was redriven (its task on its way into the
    store, e.g. a write retried): stored PENDING, it ran beside the redriven one. Found by the ordering model."""
    first = await store.submit(head(1))
    await run(store, first, Outcome.PERMANENT_FAILURE)  # on_dead release: the key moved on
    assert await store.redrive(first, T0 + 20)
    assert await status(store, first) == ["PENDING"]
    later = await store.submit(head(2))  # the failed record's retry task
    assert await status(store, first, later) == ["PENDING", "PARKED"]
    await run(store, first, Outcome.SUCCESS, T0 + 30)
    assert await status(store, later) == ["PENDING"]


async def test_the_open_tasks_gauge_counts_each_status_through_its_index(store: Store) -> None:
    """The open-tasks gauge (read every 2 s) counts PENDING, IN_FLIGHT and PARKED by queue, each through an index of
    its own: counted from every open task's row, it read 500,000 restored tasks' rows every 2 s (235 ms a time)."""
    first = await store.submit(head(10))
    for offset in (11, 12):
        await store.submit(parked(offset))
    for _ in range(3):
        await store.submit(dataclasses.replace(failure(), queue="other"))
    await store.claim_due("q", 10, LEASE, "w1", T0 + 10)  # the head: IN_FLIGHT
    assert str((await store.get(first)).status) == "IN_FLIGHT"  # type: ignore[union-attr]
    assert await store.open_counts() == {"q": {"PENDING": 0, "IN_FLIGHT": 1, "PARKED": 2},
                                         "other": {"PENDING": 3, "IN_FLIGHT": 0, "PARKED": 0}}
    plan = await plan_of(store, "count_open_by_queue_status")
    assert {"tasks_due", "tasks_lease", "tasks_order"} <= {w for step in plan for w in step.split()}, plan
    assert not any(step.startswith("SCAN tasks") and "INDEX tasks_open" in step for step in plan), plan
