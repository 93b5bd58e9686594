from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

import handlers  # noqa: F401 - registers the examples
from bridge.handler_api import HandlerContext, LeaseLost, Permanent
from bridge.registry import REGISTRY, Registry, RegistryError


def ctx(payload: bytes = b"{}", attempt: int = 1, source: str = "kafka://t/0/7") -> HandlerContext:
    return HandlerContext("01TASK", "q", attempt, 0, payload, "application/json", {"rdq.source": source})


def test_register_twice_is_an_error() -> None:
    registry = Registry()
    registry.register("charge-payment", lambda c: None, version="v3")
    with pytest.raises(RegistryError, match="already registered"):
        registry.register("charge-payment", lambda c: None)
    assert registry.get("charge-payment").version == "v3"  # type: ignore[union-attr]


def test_decorator_and_async_detection() -> None:
    registry = Registry()

    @registry.handler("a")
    async def a(c: HandlerContext) -> None:
        return None

    @registry.handler("b", version="2")
    def b(c: HandlerContext) -> None:
        return None

    assert registry.get("a").is_async and not registry.get("b").is_async  # type: ignore[union-attr]
    assert registry.names() == ["a", "b"] and "a" in registry and "zzz" not in registry
    with pytest.raises(RegistryError):
        registry.register("", b)


def test_examples_are_registered_under_spec_names() -> None:
    assert {"ok", "flaky", "permanent", "sleep", "crash"} <= set(REGISTRY.names())


def test_ok_and_flaky_log_successes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "example.log"
    monkeypatch.setenv("RDQ_EXAMPLE_LOG", str(log))
    flaky = REGISTRY.get("flaky").fn  # type: ignore[union-attr]
    REGISTRY.get("ok").fn(ctx())  # type: ignore[union-attr]
    for attempt in (1, 2):
        with pytest.raises(Exception, match="flaky"):
            flaky(ctx(b'{"fail": 2}', attempt))
    flaky(ctx(b'{"fail": 2}', 3, source="kafka://t/1/9"))
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines == [{"handler": "ok", "source": "kafka://t/0/7", "attempt": 1},
                     {"handler": "flaky", "source": "kafka://t/1/9", "attempt": 3}]


def test_permanent_and_bad_payloads_are_permanent() -> None:
    with pytest.raises(Permanent):
        REGISTRY.get("permanent").fn(ctx())  # type: ignore[union-attr]
    with pytest.raises(Permanent, match="not JSON"):
        REGISTRY.get("flaky").fn(ctx(b"\xff\xfe"))  # type: ignore[union-attr]


async def test_sleep_heartbeats_and_stops_when_lease_lost() -> None:
    beats: list[float] = []
    c = ctx(b'{"ms": 1200}')
    c._on_beat = lambda: beats.append(1)
    await REGISTRY.get("sleep").fn(c)  # type: ignore[union-attr,misc]
    assert len(beats) >= 2
    lost = ctx(b'{"ms": 5000}')
    lost.lose_lease()
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(REGISTRY.get("sleep").fn(lost), 3)  # type: ignore[union-attr,arg-type]


def test_crash_ends_the_process_abruptly() -> None:
    code = ("import handlers; from bridge.registry import REGISTRY; from bridge.handler_api import HandlerContext;"
            "REGISTRY.get('crash').fn(HandlerContext('t','q',1,0,b'','x',{})); print('survived')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9 and "survived" not in proc.stdout
