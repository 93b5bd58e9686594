"""Small builders shared by the engine tests."""

from __future__ import annotations

import asyncio
import itertools
import re
import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bridge.config import BridgeConfig, parse_config
from bridge.model import Attempt, ErrorInfo, NewTask, Outcome, Status
from bridge.store.queries import q
from bridge.store.results import RunReport

if TYPE_CHECKING:
    from bridge.store.tasks import Store

T0 = 1_800_000_000_000  # a fixed "now" in ms
_OFFSETS = itertools.count()
TRACEPARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


def engine_config(store_path: str, **queues: dict[str, Any]) -> BridgeConfig:
    return parse_config({
        "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "store": {"path": store_path},
        "queues": queues or {"q": {"handler": "ok"}},
        "engine": {"sweep_interval": "50ms", "grace_period": "2s", "handler_modules": []},
    })


def failure(queue: str = "q", now: int = T0, due_in_ms: int = 0, handler: str = "ok",
            payload: bytes = b"{}", version: str | None = None, dead: ErrorInfo | None = None) -> NewTask:
    """A first-delivery failure: PENDING due in `due_in_ms`, or DEAD with `dead` as reason."""
    outcome = Outcome.PERMANENT_FAILURE if dead else Outcome.RETRYABLE_FAILURE
    error = dead or ErrorInfo("builtins.RuntimeError", "first delivery failed", "Traceback ...")
    return NewTask(
        queue=queue, handler_ref=handler, payload=payload,
        headers={"rdq.source": f"kafka://t/0/{next(_OFFSETS)}", "traceparent": TRACEPARENT},
        status=Status.DEAD if dead else Status.PENDING, created_at=now,
        first_attempt=Attempt(1, 0, now, now, outcome, error, "test"),
        next_attempt_at=None if dead else now + due_in_ms, dead_reason=dead, handler_version=version,
    )  # fmt: skip


def report(outcome: Outcome, now: int = T0, error: ErrorInfo | None = None) -> RunReport:
    if error is None and outcome != Outcome.SUCCESS:
        error = ErrorInfo("builtins.RuntimeError", "boom")
    return RunReport(now - 5, now, outcome, error, "w1")


async def eventually(predicate: Callable[[], bool], within: float = 10.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `within` seconds pass; returns its last value (assert on it)."""
    deadline = time.monotonic() + within
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)


def query_plan(conn: sqlite3.Connection, sql: str, params: dict[str, Any] | None = None) -> list[str]:
    """SQLite's plan of `sql`, a line a step: its parameters NULL unless given, a `:rows` as one VALUES row as wide
    as the query reads."""
    if ":rows" in sql:
        width = max(int(n) for n in re.findall(r"v\.column(\d+)", sql))
        sql = sql.replace(":rows", "(" + ",".join(["NULL"] * width) + ")")
    bound = {name: None for name in re.findall(r":(\w+)", sql)} | (params or {})
    return [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, bound)]


async def plan_of(store: Store, name: str, **params: Any) -> list[str]:
    """The plan of the named query (queries.sql) on this store."""
    sql = q(name)
    return await store.db.read(lambda c: query_plan(c, sql, params))
