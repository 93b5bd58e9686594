"""The HTTP handler against a real HTTP server (aiohttp, in-process)."""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bridge.clock import SystemClock
from bridge.config import HttpHandlerConfig, parse_config
from bridge.handler_api import HandlerContext
from bridge.live_config import LiveConfig
from bridge.model import Status
from bridge.records import SourceRecord
from bridge.registry import Registry
from bridge.source.first_delivery import FirstDelivery
from bridge.store.tasks import Store
from bridge.workers.http_handler import HttpHandler, HttpPermanentError, HttpRetryableError, retry_after_seconds
from localkafka.broker import free_port

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class App:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.peers: set[Any] = set()
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": await request.read()})
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        kind = request.match_info["kind"]
        if kind == "ok":
            return web.Response(status=200, text="done")
        if kind == "bad":
            return web.Response(status=400, text="field `amount` is missing")
        if kind == "busy":
            return web.Response(status=429, text="slow down", headers={"Retry-After": "7"})
        if kind == "down":
            return web.Response(status=503, text="maintenance")
        if kind == "slow":
            await asyncio.sleep(3)
            return web.Response(status=200)
        if kind == "explicit-permanent":
            return web.Response(status=500, text="poison", headers={"rdq-outcome": "permanent"})
        if kind == "huge":
            return web.Response(status=500, body=b"x" * (8 * 1024 * 1024))
        if kind == "explicit-retryable":
            return web.Response(status=404, text="not yet", headers={"rdq-outcome": "retryable"})
        return web.Response(status=418)


@pytest.fixture
async def app() -> AsyncIterator[App]:
    state = App()
    server = web.Application()
    server.router.add_post("/{kind}", state.handle)
    runner = web.AppRunner(server)
    await runner.setup()
    state.port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", state.port)
    await site.start()
    yield state
    await runner.cleanup()


def ctx(payload: bytes = b'{"amount": 5}') -> HandlerContext:
    return HandlerContext("01TASK", "payments", 3, 1, payload, "application/json",
                          {"rdq.source": "kafka://payments/2/77", "traceparent": TRACEPARENT})


def handler(port: int, kind: str, timeout: float = 2.0) -> HttpHandler:
    return HttpHandler(HttpHandlerConfig(url=f"http://127.0.0.1:{port}/{kind}", timeout=timeout,
                                         headers={"authorization": "Bearer app-token"}))


async def test_2xx_is_success_and_the_request_carries_the_task(app: App) -> None:
    h = handler(app.port, "ok")
    await h(ctx())
    await h(ctx())
    await h.close()
    headers = app.seen[0]["headers"]
    assert app.seen[0]["body"] == b'{"amount": 5}'
    assert headers["Content-Type"] == "application/json" and headers["traceparent"] == TRACEPARENT
    assert headers["rdq.task_id"] == "01TASK" and headers["rdq.attempt"] == "3"
    assert headers["rdq.redrive_count"] == "1" and headers["rdq.source"] == "kafka://payments/2/77"
    assert headers["Authorization"] == "Bearer app-token"
    assert len(app.peers) == 1  # the connection is pooled and reused


@pytest.mark.parametrize(("kind", "error", "after"), [
    ("bad", HttpPermanentError, None),
    ("busy", HttpRetryableError, 7.0),
    ("down", HttpRetryableError, None),
    ("explicit-permanent", HttpPermanentError, None),
    ("explicit-retryable", HttpRetryableError, None),
])
async def test_responses_map_to_outcomes(app: App, kind: str, error: type[Exception], after: float | None) -> None:
    h = handler(app.port, kind)
    with pytest.raises(error) as raised:
        await h(ctx())
    await h.close()
    assert getattr(raised.value, "after", None) == after
    assert "HTTP" in str(raised.value)  # status and (truncated) body in the attempt's error
    if kind == "bad":
        assert "field `amount` is missing" in str(raised.value)


async def test_a_slow_app_times_out_retryably(app: App) -> None:
    h = handler(app.port, "slow", timeout=0.5)
    began = time.monotonic()
    with pytest.raises(HttpRetryableError, match="no answer"):
        await h(ctx())
    await h.close()
    assert time.monotonic() - began < 2.5


async def test_no_app_at_all_is_retryable() -> None:
    h = handler(free_port(), "ok")
    with pytest.raises(HttpRetryableError, match="ClientConnectorError"):
        await h(ctx())
    await h.close()


def test_retry_after_forms() -> None:
    assert retry_after_seconds("120") == 120
    now = time.time()
    assert retry_after_seconds(email.utils.formatdate(now + 30, usegmt=True), now) == pytest.approx(30, abs=1)
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None


async def test_retry_after_sets_when_the_task_runs_again(app: App, tmp_path: Path) -> None:
    """Through first delivery: a 429 with Retry-After: 7 stores a task due 7 s later, not after the backoff."""
    config = parse_config({"kafka": {"bootstrap_servers": "x:1"}, "store": {"path": str(tmp_path / "rdq.db")},
                           "queues": {"payments": {"handler": "app", "sources": ["payments"],
                                                   "http": {"url": f"http://127.0.0.1:{app.port}/busy"},
                                                   "backoff": {"kind": "fixed", "base": "1s"}}},
                           "engine": {"handler_modules": []}})
    http = HttpHandler(config.queues["payments"].http)  # type: ignore[arg-type]
    registry = Registry().extended({"app": http})
    store = await Store.open(config.store.path)
    try:
        delivery = FirstDelivery(store, LiveConfig(config), registry, SystemClock(), None, "test")
        record = SourceRecord("payments", 0, 5, b"k", b"{}", None, (("traceparent", TRACEPARENT.encode()),))
        assert await delivery.handle(record, "payments") == Status.PENDING
        [listed] = await store.list_tasks()
        task = await store.get(listed.id)
        assert task is not None and task.next_attempt_at is not None
        assert task.next_attempt_at - task.attempts[0].finished_at == 7000
        assert task.attempts[0].error is not None and "429" in task.attempts[0].error.message
        assert task.attempts[0].error.type == "bridge.http_handler.HttpRetryableError"
    finally:
        await http.close()
        await store.close()


async def test_a_record_s_content_type_or_tracestate_with_cr_lf_cannot_break_the_request(app: App) -> None:
    """A CR/LF in either made aiohttp raise on every attempt: the task retried until DEAD for a header."""
    h = handler(app.port, "ok")
    evil = HandlerContext("01TASK", "payments", 1, 0, b"{}", "text/plain\r\nX-Injected: 1",
                          {"rdq.source": "kafka://payments/2/77", "traceparent": TRACEPARENT,
                           "tracestate": "a=b\r\nX-Injected: 2"})
    await h(evil)
    await h.close()
    headers = app.seen[-1]["headers"]
    assert headers["Content-Type"] == "text/plainX-Injected: 1" and "X-Injected" not in headers
    assert "tracestate" not in headers


async def test_only_a_bounded_part_of_a_response_body_is_read(app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    import bridge.workers.http_handler

    read: list[int] = []
    original = bridge.workers.http_handler.read_body

    async def counting(response: Any, limit: int = bridge.workers.http_handler.BODY_READ_MAX) -> str:
        text = await original(response, limit)
        read.append(len(text))
        return text

    monkeypatch.setattr(bridge.workers.http_handler, "read_body", counting)
    h = handler(app.port, "huge")
    with pytest.raises(HttpRetryableError) as raised:
        await h(ctx())
    await h.close()
    assert read == [bridge.workers.http_handler.BODY_READ_MAX] and len(str(raised.value)) < 3000


def test_an_http_queue_is_not_reported_as_naming_an_unregistered_handler(caplog: pytest.LogCaptureFixture) -> None:
    """`rdq run` checks each queue's handler at start: an `http:` queue's handler is made from its config, not
    looked up (the check said "not registered" for it at every start); a queue naming a missing one is reported."""
    from bridge.service import check_handlers

    config = parse_config({
        "kafka": {"bootstrap_servers": "127.0.0.1:9"}, "store": {"path": "unused.db"},
        "queues": {"pay": {"handler": "pay", "sources": ["in"], "dlq_topic": "dlq",
                           "http": {"url": "http://127.0.0.1:9/pay"}},
                   "lost": {"handler": "nowhere", "sources": ["in2"], "dlq_topic": "dlq2"}}})
    with caplog.at_level("ERROR"):
        check_handlers(config, Registry())
    assert "queue lost names handler 'nowhere', which is not registered" in caplog.text
    assert "queue pay" not in caplog.text
