"""The changelog writer's outbox read in a process of its own (bridge/changelog/outbox_read.py): what it reads is what
the store's reader thread reads, it starts only for a large round, and when it dies no round is lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest

from bridge.changelog.local import HomeState, LocalIndex
from bridge.changelog.outbox_read import MAX_STARTS, PROCESS_FROM, OutboxReader, outbox_rows
from bridge.store.history import pack
from bridge.store.tasks import Store
from tests.test_changelog_store import HOME, _insert_random, _random_row, on, scoped_store


def _params(limit: int, skip: list[str] | None = None, sent: list[str] | None = None) -> dict[str, Any]:
    return {"limit": limit, "skip": orjson.dumps(skip or []).decode(), "sent": orjson.dumps(sent or []).decode()}


async def _up(reader: OutboxReader) -> None:
    """Start its process and wait until it answers (a bridge reads on the thread meanwhile)."""
    if not reader.process.started:
        reader.process.start()
    assert reader.process._started is not None
    await asyncio.wrap_future(reader.process._started)
    assert reader.process.ready


async def _thread_rows(store: Store, params: dict[str, Any], max_bytes: int = 1 << 30) -> list[Any]:
    return await store.db.scan(lambda conn: outbox_rows(conn, params, max_bytes))


def _restored_history(conn: Any, task_ids: list[str]) -> None:
    """Histories as a restore leaves them (packed: read back through rdq_history, a function of the bridge's)."""
    for n, task_id in enumerate(task_ids):
        history = [{"seq": 40 + n, "attempt_no": 1, "redrive_no": 0, "started_at": 1, "finished_at": 2,
                    "outcome": "LEASE_EXPIRED", "error_type": "e", "error_message": "m\u0000é", "error_stack": None,
                    "worker": "w", "late_result_of": None, "note": None}]
        conn.execute("INSERT INTO restored_attempts (task_id, attempts) VALUES (?, ?)",
                     (task_id, pack(json.dumps(history).encode())))


async def test_the_process_reads_what_the_store_thread_reads(tmp_path: Path) -> None:
    """On 600 random tasks (binary payloads, control and non-BMP characters, big integers, NULLs, attempts,
    redrives, restored packed histories), with states skipped and sent left out and a byte bound, the process's
    rows are the thread's, in the same order."""
    rng = random.Random(20261206)
    rows = [_random_row(rng, i) for i in range(600)]
    store, local = await scoped_store(tmp_path)
    reader = OutboxReader(store)  # the process started by hand below
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        await store.db.write(lambda conn: _insert_random(conn, rng, rows))
        await store.db.write(lambda conn: _restored_history(conn, [r["id"] for r in rows[::7]]))
        skip = [r["id"] for r in rows[::11]]
        sent = [f"{r['id']} {r['version']}" for r in rows[::13]]
        await _up(reader)
        for params, max_bytes in ((_params(1000), 1 << 30), (_params(1000, skip, sent), 1 << 30),
                                  (_params(50), 1 << 30), (_params(1000), 200_000)):
            here = await _thread_rows(store, params, max_bytes)
            there = await reader.read(params, max_bytes)
            assert there == here and here
        assert reader.reads_in_process == 4
        restored = {r["id"] for r in rows[::7]}
        history = {row[0]: orjson.loads(row[4])["attempts"] for row in here}
        assert all(any(a["seq"] >= 40 for a in history[i]) for i in restored if i in history)
    finally:
        reader.close()
        await store.close()


async def test_it_starts_only_for_a_large_round_and_a_killed_one_loses_no_round(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "rdq.db", scoped=True)
    local = LocalIndex(store, outbox_process=True)
    try:
        await local.set_changelogged(["src"])
        await local.set_home(HOME, HomeState.ACTIVE)
        await store.submit_many([on("src", 0, i) for i in range(10)])
        assert len(await local.outbox(5000)) == 10
        assert not local.outbox_reader.process.started  # a quiet writer: no process

        await store.submit_many([on("src", 0, i) for i in range(10, 10 + PROCESS_FROM)])
        first = await local.outbox(5000)  # read on the thread; the process starts for the next rounds
        assert len(first) == 10 + PROCESS_FROM and local.outbox_reader.process.started
        await _up(local.outbox_reader)
        assert await local.outbox(5000) == first and local.outbox_reader.reads_in_process == 1

        pid = local.outbox_reader.process.pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert await local.outbox(5000) == first  # read on the thread instead: nothing of the round lost
        assert not local.outbox_reader.process.ready
        assert await local.outbox(5000) == first and local.outbox_reader.starts == 2  # started again
        await _up(local.outbox_reader)
        await local.mark_logged(first[:500])
        assert await local.outbox(5000) == first[500:] and local.outbox_reader.reads_in_process == 2
    finally:
        local.close()
        await store.close()


async def test_no_process_where_no_core_is_to_spare(tmp_path: Path) -> None:
    """A bridge of a supervisor's with as many siblings as cores (or one bridge on one core) reads its outbox on
    the thread, however large its rounds: a process would take a sibling's core."""
    store = await Store.open(tmp_path / "rdq.db", scoped=True)
    local = LocalIndex(store, outbox_process=False)
    try:
        await local.set_changelogged(["src"])
        await local.set_home(HOME, HomeState.ACTIVE)
        await store.submit_many([on("src", 0, i) for i in range(PROCESS_FROM + 10)])
        assert len(await local.outbox(5000)) == PROCESS_FROM + 10
        assert not local.outbox_reader.process.started
    finally:
        local.close()
        await store.close()


def test_a_core_is_to_spare_with_more_cores_than_bridge_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from bridge.config import processes
    from bridge.config.processes import CHILD_ENV, ChildSpec, core_to_spare

    monkeypatch.setattr(processes, "cores", lambda: 2)
    assert core_to_spare({})  # one bridge, two cores
    assert not core_to_spare({CHILD_ENV: ChildSpec(0, 2).to_env()})  # processes: 2 on two cores
    monkeypatch.setattr(processes, "cores", lambda: 4)
    assert core_to_spare({CHILD_ENV: ChildSpec(1, 3).to_env()})
    monkeypatch.setattr(processes, "cores", lambda: 1)
    assert not core_to_spare({})
    assert not core_to_spare({CHILD_ENV: "not json"})  # a bad description: no process (serve refuses it anyway)


async def test_a_process_that_cannot_open_the_store_leaves_the_reads_on_the_thread(tmp_path: Path,
                                                                                   caplog: Any) -> None:
    """Its read-only connection fails to open (here: a path it cannot read): each failed start is said, tried
    again at most MAX_STARTS times, and every round is read on the store's thread, as before the process existed."""
    store, local = await scoped_store(tmp_path)
    reader = OutboxReader(store)
    reader.process._initargs = (str(tmp_path / "no-such-dir" / "rdq.db"), 0.1)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        await store.submit_many([on("src", 0, i) for i in range(PROCESS_FROM)])
        params = _params(5000)
        first = await reader.read(params, 1 << 30)  # on the thread; starts the process
        assert len(first) == PROCESS_FROM and reader.process.started
        for _ in range(2 * MAX_STARTS):
            if reader.process._started is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(reader.process._started)
            assert await reader.read(params, 1 << 30) == first
        assert reader.reads_in_process == 0 and reader.starts == MAX_STARTS and not reader.process.started
        assert caplog.text.count("did not start") == MAX_STARTS
    finally:
        reader.close()
        await store.close()


@pytest.mark.parametrize("child", [None, 0, 1])
async def test_a_bridge_gives_its_helper_processes_only_a_core_to_spare(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, child: int | None) -> None:
    """The changelog's outbox read and a large restore's decoding run in processes of their own where a core is to
    spare, on the bridge's threads where not: with `processes: 2` on two cores a helper would take the sibling's
    core, and a restore's decoding process cost more CPU a task than the thread's (bench_processes restore)."""
    from bridge.changelog.decoder import PROCESS_FROM as RESTORE_PROCESS_FROM
    from bridge.config import processes
    from bridge.config.processes import CHILD_ENV, ChildSpec
    from bridge.registry import Registry
    from bridge.service import Bridge
    from tests.helpers import engine_config

    monkeypatch.setattr(processes, "cores", lambda: 2)
    if child is None:
        monkeypatch.delenv(CHILD_ENV, raising=False)  # one bridge on two cores: a core to spare
    else:
        monkeypatch.setenv(CHILD_ENV, ChildSpec(child, 2).to_env())  # one of two on two cores: none
    store = await Store.open(tmp_path / "rdq.db", scoped=True)
    bridge = Bridge(engine_config(str(tmp_path / "rdq.db")), store, Registry(), changelog_topics={"src": "cl"})
    try:
        assert bridge.changelog is not None
        assert bridge.changelog.local.outbox_reader.use_process is (child is None)
        assert bridge.changelog.restorer.process_from == (RESTORE_PROCESS_FROM if child is None else None)
    finally:
        bridge.changelog.local.close()
        await store.close()
