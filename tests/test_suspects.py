"""Records in flight when the bridge died (suspects, SPEC §4.1 and §4.4): what each becomes at the next start.

The journal holds a poll's offset range, not the records that began, so a suspect may never have run. Its
LEASE_EXPIRED attempt counts against max_attempts only if attempts remain after it (how a poison pill that kills
its bridge is bounded); where it would be the last, it stays in the history uncounted and the task is retried.
A remote queue's record never runs here: it is stored as it would have been. The whole path, with a SIGKILL, is
`test_records_in_flight_at_a_kill_are_retried_not_dead_lettered_with_max_attempts_1` (test_kafka_faults.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bridge.clock import SystemClock
from bridge.config import parse_config
from bridge.live_config import LiveConfig
from bridge.model import NewTask, Outcome, Status, Task
from bridge.records import SourceRecord
from bridge.registry import Registry
from bridge.source.first_delivery import SUSPECT_NOTE, FirstDelivery
from bridge.store.tasks import Store

BACKOFF = {"kind": "fixed", "base": "2s"}


def _delivery(tmp_path: Path, store: Store) -> FirstDelivery:
    config = parse_config({
        "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "store": {"path": str(tmp_path / "rdq.db")},
        "queues": {
            "once": {"handler": "h", "sources": ["t1"], "max_attempts": 1, "backoff": BACKOFF},
            "thrice": {"handler": "h", "sources": ["t3"], "max_attempts": 3, "backoff": BACKOFF},
            "far": {"handler": "h", "sources": ["tr"], "max_attempts": 1, "remote": True},
        },
        "workers": {"listen": ["tcp://127.0.0.1:0"], "tokens": ["x" * 32]},
        "engine": {"handler_modules": []},
    }, "<test>")
    registry = Registry()
    registry.register("h", lambda ctx: None)
    return FirstDelivery(store, LiveConfig(config), registry, SystemClock(), None, "test-1")


def _suspect(delivery: FirstDelivery, topic: str, queue: str) -> Any:
    return delivery.prepare(SourceRecord(topic, 0, 7, b"k", b"{}", None, ()), queue, suspect=True)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open(tmp_path / "rdq.db")
    yield opened
    await opened.close()


async def _stored_suspect(store: Store, tmp_path: Path, topic: str, queue: str) -> Task:
    """A suspect of the queue's, as `prepare` makes it (a PENDING task, its attempt LEASE_EXPIRED) and stored."""
    task = _suspect(_delivery(tmp_path, store), topic, queue)
    assert isinstance(task, NewTask) and task.status is Status.PENDING
    assert task.first_attempt is not None and task.first_attempt.outcome is Outcome.LEASE_EXPIRED
    assert task.next_attempt_at == task.created_at + 2000  # the queue's backoff after attempt 1
    await store.submit(task)
    stored = await store.get(task.id)
    assert stored is not None and stored.status is Status.PENDING
    return stored


async def test_a_suspect_whose_attempt_would_be_its_last_is_retried_with_it_uncounted(store: Store,
                                                                                      tmp_path: Path) -> None:
    stored = await _stored_suspect(store, tmp_path, "t1", "once")
    assert stored.attempt_count == 0
    assert [a.note for a in stored.attempts] == [SUSPECT_NOTE]  # in the history all the same


async def test_a_suspect_with_attempts_left_counts_its_attempt(store: Store, tmp_path: Path) -> None:
    stored = await _stored_suspect(store, tmp_path, "t3", "thrice")
    assert stored.attempt_count == 1  # a poison pill is still caught in 3 kills
    assert [a.note for a in stored.attempts] == [None]


async def test_a_remote_queues_suspect_is_stored_as_it_would_have_been(store: Store, tmp_path: Path) -> None:
    """Its handler runs in remote workers, never here: a crash cannot have been its doing, no attempt is spent."""
    task = _suspect(_delivery(tmp_path, store), "tr", "far")
    assert isinstance(task, NewTask) and task.status is Status.PENDING and task.first_attempt is None
    assert task.next_attempt_at == task.created_at
