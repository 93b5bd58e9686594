"""Safe bulk redrive (SPEC §13), in-process on a real store: the pace, the loop guard, shares, a canary's ids,
outcomes by request, an early end when the bridge stops. The same through Kafka and the CLI: test_redrive_kafka."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bridge.admin.commands import AdminCommands
from bridge.admin.protocol import CancelArgs, Command, RedriveArgs, StatsArgs
from bridge.engine.core import Engine
from bridge.live_config import LiveConfig
from bridge.model import ErrorInfo, Status
from bridge.registry import Registry
from bridge.store.tasks import Store
from tests.helpers import engine_config, failure


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[AdminCommands, Store, Path]]:
    path = tmp_path / "rdq.db"
    config = engine_config(str(path), q={"handler": "ok", "max_redrives": 2})
    store = await Store.open(config.store.path)
    engine = Engine(store, LiveConfig(config), Registry(), instance_id="me")
    try:
        yield AdminCommands(engine, lambda t, p, o: None), store, path
    finally:
        engine.close()
        await store.close()


async def _dead(store: Store, n: int) -> list[str]:
    return list(await asyncio.gather(*(store.submit(failure(dead=ErrorInfo("rdq.Unroutable", "x")))
                                       for _ in range(n))))


def _cmd(request_id: str = "r-1", **args: Any) -> Command:
    return Command(request_id, "redrive", RedriveArgs(**args), 0, "sre", "k1")


async def _run(commands: AdminCommands, cmd: Command, progress: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    async def report(update: dict[str, Any]) -> None:
        if progress is not None:
            progress.append(update["progress"])

    return await commands.run(cmd, report)


def _set_redrive_count(path: Path, ids: list[str], count: int) -> None:
    """As if these tasks had come back DEAD from `count` earlier redrives."""
    with sqlite3.connect(path) as conn:
        conn.executemany("UPDATE tasks SET redrive_count = ? WHERE id = ?", [(count, i) for i in ids])


async def test_a_bulk_redrive_holds_its_rate_and_reports_progress(rig: tuple[AdminCommands, Store, Path]) -> None:
    commands, store, _ = rig
    await _dead(store, 600)
    progress: list[dict[str, Any]] = []
    began = time.monotonic()
    result = await _run(commands, _cmd(queue="q", limit=1000, rate=250), progress)
    elapsed = time.monotonic() - began
    assert result["count"] == 600 and result["matched"] == 600
    assert 2.4 * 0.9 <= elapsed <= 2.4 * 1.1, elapsed  # 600 tasks at 250/s
    assert 225 <= result["rate"] <= 275
    assert result["outcomes"] == {"succeeded": 0, "failed": 0, "waiting": 600, "gone": 0}  # nothing ran them
    assert len(progress) == 2 and [p["done"] for p in progress] == sorted(p["done"] for p in progress)
    assert all(p["total"] == 600 and 200 <= p["rate"] <= 300 for p in progress)
    assert (await store.counts())["q"]["PENDING"] == 600


async def test_without_a_rate_a_bulk_redrive_goes_at_the_safe_default(rig: tuple[AdminCommands, Store, Path]) -> None:
    commands, store, _ = rig
    await _dead(store, 150)
    began = time.monotonic()
    assert (await _run(commands, _cmd(queue="q", limit=1000)))["count"] == 150
    assert time.monotonic() - began >= 1.5 * 0.9  # 100/s


async def test_the_loop_guard_refuses_tasks_redriven_max_redrives_times_and_force_passes_it(
        rig: tuple[AdminCommands, Store, Path]) -> None:
    commands, store, path = rig
    ids = await _dead(store, 10)
    looping = ids[:4]
    _set_redrive_count(path, looping, 2)  # the queue's max_redrives
    dry = await _run(commands, _cmd(queue="q", dry_run=True))
    assert dry["count"] == 6 and dry["refused_count"] == 4
    assert {r["id"] for r in dry["refused"]} == set(looping)
    assert all(r["reason"] == "LoopGuard" and "max_redrives is 2" in r["message"] for r in dry["refused"])
    done = await _run(commands, _cmd(queue="q", rate=1000))
    assert sorted(done["redriven"]) == sorted(ids[4:]) and done["refused_count"] == 4
    one = await _run(commands, _cmd("r-2", task_id=looping[0]))
    assert one["count"] == 0 and one["refused"][0]["reason"] == "LoopGuard"
    listed = await _run(commands, _cmd("r-3", task_ids=looping[1:]))
    assert listed["count"] == 0 and listed["refused_count"] == 3
    assert not await store.redrive(looping[0], 0, max_redrives=2)  # the store's compare-and-set guards too
    forced = await _run(commands, _cmd("r-4", queue="q", rate=1000, force=True))
    assert sorted(forced["redriven"]) == sorted(looping) and forced["refused_count"] == 0
    task = await store.get(looping[0])
    assert task is not None and task.redrive_count == 3 and task.status == Status.PENDING


async def test_shares_give_each_instance_its_rate_and_limit(rig: tuple[AdminCommands, Store, Path]) -> None:
    commands, store, _ = rig
    await _dead(store, 30)
    other = await _run(commands, _cmd(queue="q", shares={"someone-else": {"rate": 1000, "limit": 30}}))
    assert other["count"] == 0 and "no share" in other["note"]
    mine = await _run(commands, _cmd("r-2", queue="q", shares={"me": {"rate": 1000, "limit": 12}}))
    assert mine["count"] == 12


async def test_a_canary_by_ids_then_the_rest_without_them(rig: tuple[AdminCommands, Store, Path]) -> None:
    commands, store, _ = rig
    ids = await _dead(store, 20)
    canary = await _run(commands, _cmd("canary", task_ids=[*ids[:3], "not-here"]))
    assert sorted(canary["redriven"]) == sorted(ids[:3]) and canary["held"] == 3
    outcomes = await commands.run(Command("s", "stats", StatsArgs(redrive="canary"), 0, "sre"), _noop)
    assert outcomes["outcomes"] == {"succeeded": 0, "failed": 0, "waiting": 3, "gone": 0}
    assert await store.purge_task(ids[0]) is False  # not finished: a purge keeps it
    rest = await _run(commands, _cmd("rest", queue="q", rate=1000, exclude=ids[:3], limit=100))
    assert sorted(rest["redriven"]) == sorted(ids[3:])


async def test_a_bulk_redrive_ends_early_when_the_bridge_stops(rig: tuple[AdminCommands, Store, Path]) -> None:
    commands, store, _ = rig
    await _dead(store, 400)
    running = asyncio.create_task(_run(commands, _cmd(queue="q", limit=1000, rate=200)))
    await asyncio.sleep(0.5)
    commands.stopping.set()
    result = await asyncio.wait_for(running, 2)
    assert 50 <= result["count"] < 400 and "stopping" in result["interrupted"]
    assert (await store.counts())["q"]["DEAD"] == 400 - result["count"]


async def test_a_bulk_redrive_stops_at_its_next_batch_when_cancelled(rig: tuple[AdminCommands, Store, Path]) -> None:
    commands, store, _ = rig
    await _dead(store, 400)
    running = asyncio.create_task(_run(commands, _cmd("r-1", queue="q", limit=1000, rate=200)))
    await asyncio.sleep(0.5)
    assert commands.redrives.cancel("r-1", "sre@host (key k1)")
    result = await asyncio.wait_for(running, 2)
    assert 50 <= result["count"] < 400 and result["interrupted"].startswith("cancelled by sre@host (key k1)")
    assert (await store.counts())["q"]["DEAD"] == 400 - result["count"]
    assert commands.redrives.running == set() and commands.redrives.cancelled == {}


async def _noop(update: dict[str, Any]) -> None:
    return None


def test_the_progress_line_shows_each_instance_the_rate_and_an_eta() -> None:
    import io

    from bridge.cli.redrive import Progress, pick_canary, shares_for

    out = io.StringIO()
    progress = Progress(out, began=time.monotonic() - 10, totals={"a": 3000, "b": 1000})
    progress({"instance": "a", "result": {"progress": {"done": 600, "total": 3000}}})
    progress({"instance": "b", "result": {"progress": {"done": 400, "total": 1000}}})
    line = out.getvalue().split("\r")[-1]
    assert line.startswith("redrive: 1000/4000 (25%) · 100/s · ETA 30s · a 600/3000 · b 400/1000")
    # The group's rate is shared in proportion to the tasks each instance holds; a canary takes from each in turn.
    assert shares_for({"a": 3000, "b": 1000, "c": 0}, 400) == {"a": {"rate": 300.0, "limit": 3000},
                                                              "b": {"rate": 100.0, "limit": 1000}}
    assert pick_canary({"a": ["a1", "a2", "a3"], "b": ["b1"]}, 3) == ["a1", "b1", "a2"]


async def test_a_cancel_sent_while_a_bulk_redrive_still_plans_is_not_lost(
        rig: tuple[AdminCommands, Store, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The redrive registered itself only after its scan of the dead tasks: a cancel that arrived meanwhile found
    nothing under way and was lost, and the whole queue was redriven."""
    commands, store, _ = rig
    await _dead(store, 100)
    scan = store.dead_candidates
    planning = asyncio.Event()

    async def slow_scan(*args: Any, **kwargs: Any) -> Any:
        planning.set()
        await asyncio.sleep(0.5)  # a scan of a large store
        return await scan(*args, **kwargs)

    monkeypatch.setattr(store, "dead_candidates", slow_scan)
    running = asyncio.create_task(_run(commands, _cmd("r-2", queue="q", limit=1000, rate=1000)))
    await asyncio.wait_for(planning.wait(), 5)
    assert commands.redrives.cancel("r-2", "sre@host (key k1)")
    result = await asyncio.wait_for(running, 5)
    assert result["count"] == 0 and result["interrupted"].startswith("cancelled by sre@host")
    assert (await store.counts())["q"]["DEAD"] == 100
    assert commands.redrives.running == set() and commands.redrives.cancelled == {}


async def test_a_cancel_read_before_its_redrive_stops_it_before_its_first_batch(
        rig: tuple[AdminCommands, Store, Path]) -> None:
    """Command records keep their order within a partition only: a cancel keyed apart from its redrive (kcat, any
    other client) may be read first. It is kept (armed) and the redrive, read later, stops before its first batch;
    one kept longer than EARLY_CANCEL_KEPT_S stops nothing."""
    commands, store, _ = rig
    await _dead(store, 100)
    cancel = CancelArgs(request_id="r-3")
    assert await commands.cancel(cancel, Command("c-1", "cancel", cancel, 0, "sre", "k1"), _noop) == {
        "request_id": "r-3", "running": False, "armed": True}
    result = await asyncio.wait_for(_run(commands, _cmd("r-3", queue="q", limit=1000, rate=1000)), 5)
    assert result["count"] == 0 and result["interrupted"].startswith("cancelled by sre")
    assert (await store.counts())["q"]["DEAD"] == 100
    assert commands.redrives.running == set() and commands.redrives.cancelled == {} and commands.redrives.early == {}
    # Kept too long: the redrive runs whole.
    assert not commands.redrives.cancel("r-4", "sre")
    by, _ = commands.redrives.early["r-4"]
    commands.redrives.early["r-4"] = (by, time.monotonic() - 1)
    result = await asyncio.wait_for(_run(commands, _cmd("r-4", queue="q", limit=1000, rate=1000)), 5)
    assert result["count"] == 100 and "interrupted" not in result

