"""The circuit breaker on a real broker with a real HTTP downstream (SPEC §11): an outage is held, not spent."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bridge.config import BridgeConfig
from bridge.engine.breaker import State
from bridge.service import Bridge
from localkafka.broker import free_port
from tests.conftest import KafkaEnv
from tests.kafka_helpers import aread_dlq, await_lag, kafka_config, lag, produce, running_bridge, wait_until

pytestmark = pytest.mark.kafka

# Small windows and open durations, so an outage of seconds is a test, not a coffee break.
BREAKER = {"window": "5s", "min_attempts": 20, "open_for": "500ms", "max_open_for": "2s", "reset_after": "10s",
           "ramp": "1s"}


@dataclass
class Downstream:
    """The app behind the HTTP handler: 503 while `down`; per record, 400 for `permanent`, 503 for `poison`."""

    down: bool = False
    port: int = 0
    succeeded: set[int] = field(default_factory=set)
    requests: int = 0
    refused_while_down: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = json.loads(await request.read())
        if self.down:
            self.refused_while_down += 1
            return web.Response(status=503, text="payments API is down")
        if body.get("kind") == "permanent":
            return web.Response(status=400, text="bad record")
        if body.get("kind") == "poison":
            return web.Response(status=503, text="this record always fails")
        self.succeeded.add(int(body["n"]))
        return web.Response(status=200, text="ok")


@pytest.fixture
async def downstream() -> AsyncIterator[Downstream]:
    state = Downstream()
    app = web.Application()
    app.router.add_post("/pay", state.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    state.port = free_port()
    await web.TCPSite(runner, "127.0.0.1", state.port).start()
    yield state
    await runner.cleanup()


def config_for(kafka: KafkaEnv, tmp_path: Path, unique: str, port: int, **queue: Any) -> BridgeConfig:
    return kafka_config(kafka.bootstrap_servers, tmp_path, unique, {
        "q": {"handler": "payments", "sources": [f"in-{unique}"], "dlq_topic": f"dlq-{unique}",
              "http": {"url": f"http://127.0.0.1:{port}/pay", "timeout": "2s"},
              "max_attempts": 3, "backoff": {"kind": "fixed", "base": "200ms"}, "breaker": BREAKER, **queue}})


def transitions(bridge: Bridge) -> dict[str, float]:
    return {s.labels["to"]: s.value for m in bridge.telemetry.metrics.breaker_transitions.collect()
            for s in m.samples if s.name.endswith("_total")}


async def test_an_outage_is_held_and_no_record_reaches_the_dlq(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                                               downstream: Downstream) -> None:
    """2,000 records while the downstream answers 503, max_attempts 3: afterwards all succeed, none is in the DLQ,
    each task spent few attempts, and the source lag grew during the outage and drained after."""
    config = config_for(kafka, tmp_path, unique, downstream.port)
    topic = f"in-{unique}"
    downstream.down = True
    async with running_bridge(config) as bridge:
        breaker = bridge.engine.scheduler.breakers.of("q")
        produce(config, topic, [(None, json.dumps({"n": i}).encode(), []) for i in range(2000)])
        await wait_until(lambda: breaker.state == State.OPEN, within=60, what="the breaker to open")
        lags = []
        for _ in range(20):  # four seconds of outage, past several failed probes
            lags.append(await lag(config, topic))
            await asyncio.sleep(0.2)
        assert bridge.engine.scheduler.held_queues() == {"q"}
        downstream.down = False
        await wait_until(lambda: len(downstream.succeeded) == 2000, within=120, what="every record to succeed")
        await await_lag(config, topic, 0, within=60)
        tasks = await bridge.store.list_tasks("q", limit=10_000)
        histories = [await bridge.store.get(t.id) for t in tasks]
        seen = transitions(bridge)
    spent = collections.Counter(t.attempt_count for t in tasks)
    print(f"tasks {len(tasks)}, attempts per task {dict(sorted(spent.items()))}, transitions {seen}, "
          f"requests refused while down {downstream.refused_while_down}, lag during the outage {max(lags)}")
    assert await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", settle=1.0) == []
    assert all(t.status == "SUCCEEDED" for t in tasks)
    # Few tasks reached their last attempt (the retries that ran before the trip or in the ramp); a slack of a few
    # tasks, as a quiet machine trips within ~40 tasks (10% of 39 is 3: 4 was seen).
    assert max(spent) <= 3 and sum(n for a, n in spent.items() if a == 3) <= max(5, len(tasks) // 10)
    # The breaker held the rest: far fewer requests reached the down app than 2,000 records x 3 attempts.
    assert downstream.refused_while_down < 600, downstream.refused_while_down
    assert max(lags) > 1000  # consumption stopped: the lag grew while the downstream was down
    assert seen.get("open", 0) >= 1 and seen.get("closed", 0) >= 1
    # The history says which attempts came after waiting out the outage (a DLQ reader can tell them apart).
    noted = [h for h in histories if h is not None and h.attempts and h.attempts[-1].note
             and "circuit breaker" in h.attempts[-1].note]
    assert len(noted) >= len(tasks) * 9 // 10, (len(noted), len(tasks))


async def test_a_long_outage_with_two_attempts_puts_nothing_in_the_dlq(kafka: KafkaEnv, tmp_path: Path,
                                                                        unique: str, downstream: Downstream) -> None:
    """max_attempts: 2 (a first delivery and one retry) and an outage of many half-open rounds: each probe is a
    real request, yet its retryable failure spends no attempt (SPEC §11). Before, every failed probe dead-lettered
    its task while the downstream was down."""
    from bridge.engine.recorder import PROBE_NOTE

    config = config_for(kafka, tmp_path, unique, downstream.port, max_attempts=2,
                        breaker={**BREAKER, "max_open_for": "1s"})
    topic = f"in-{unique}"
    downstream.down = True
    async with running_bridge(config) as bridge:
        breaker = bridge.engine.scheduler.breakers.of("q")
        produce(config, topic, [(None, json.dumps({"n": i}).encode(), []) for i in range(300)])
        await wait_until(lambda: breaker.state == State.OPEN, within=60, what="the breaker to open")
        await asyncio.sleep(10)  # about ten half-open rounds, each probe failing
        probes = transitions(bridge).get("half-open", 0)
        downstream.down = False
        await wait_until(lambda: len(downstream.succeeded) == 300, within=120, what="every record to succeed")
        tasks = [await bridge.store.get(t.id) for t in await bridge.store.list_tasks("q", limit=1000)]
    assert probes >= 5, transitions
    assert await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", settle=1.0) == []
    spared = [a for t in tasks if t is not None for a in t.attempts if a.note == PROBE_NOTE]
    assert len(spared) >= probes - 1  # the probes that failed are in the histories
    assert all(t is not None and t.status == "SUCCEEDED" for t in tasks)


async def test_poison_records_in_a_healthy_stream_never_open_it(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                                                downstream: Downstream) -> None:
    """1 in 50 records fails for good, 1 in 50 retryably for ever: the breaker stays closed and they reach the DLQ
    after max_attempts as always, while the healthy records keep flowing."""
    config = config_for(kafka, tmp_path, unique, downstream.port)
    topic = f"in-{unique}"

    def kind(i: int) -> str:
        return "permanent" if i % 50 == 0 else "poison" if i % 50 == 25 else "ok"

    batches = 10
    async with running_bridge(config) as bridge:
        for batch in range(batches):  # a stream, not one burst: healthy records flow while the poison retries
            produce(config, topic, [(None, json.dumps({"n": i, "kind": kind(i)}).encode(), [])
                                    for i in range(batch * 200, (batch + 1) * 200)])
            await asyncio.sleep(0.3)
        healthy = {i for i in range(batches * 200) if kind(i) == "ok"}
        await wait_until(lambda: downstream.succeeded >= healthy, within=60, what="the healthy records")
        dead = await wait_for_dlq(kafka, unique, 2 * batches * 4)
        seen = transitions(bridge)
        assert bridge.engine.scheduler.breakers.of("q").state == State.CLOSED
    assert seen == {}, seen
    reasons = collections.Counter(d.value["reason"]["type"] for d in dead)
    assert reasons == {"bridge.http_handler.HttpPermanentError": batches * 4,
                       "bridge.http_handler.HttpRetryableError": batches * 4}, reasons
    # The always-503 records spent their 3 attempts; the 400 ones went at once (or after a retryable timeout of
    # the app on a loaded machine: the 400 still ended them before max_attempts).
    attempts = {kind: collections.Counter(len(d.value["attempts"]) for d in dead if d.value["reason"]["type"] == kind)
                for kind in reasons}
    assert attempts["bridge.http_handler.HttpRetryableError"] == {3: batches * 4}, attempts
    assert attempts["bridge.http_handler.HttpPermanentError"][1] >= batches * 4 - 2, attempts


async def wait_for_dlq(kafka: KafkaEnv, unique: str, n: int) -> list[Any]:
    found: list[Any] = []

    async def enough() -> bool:
        found[:] = await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", settle=0.5, expect=n)
        return len(found) >= n

    await wait_until(enough, within=90, interval=0.5, what=f"{n} records in the DLQ")
    return found


async def test_a_flapping_downstream_does_not_thrash_it_and_loses_nothing(kafka: KafkaEnv, tmp_path: Path,
                                                                          unique: str,
                                                                          downstream: Downstream) -> None:
    """Up 2 s, down 2 s: each re-trip soon after closing waits twice as long, so the transitions per minute stay
    bounded; every record still succeeds once (max_attempts high: this is about churn, not exhaustion)."""
    config = config_for(kafka, tmp_path, unique, downstream.port, max_attempts=50,
                        breaker={**BREAKER, "window": "1s", "max_open_for": "8s"})
    topic = f"in-{unique}"
    n = 3200
    async with running_bridge(config) as bridge:

        async def flap() -> None:
            while True:
                downstream.down = not downstream.down
                await asyncio.sleep(2)

        began = asyncio.get_running_loop().time()
        timeline: list[str] = []
        bridge.engine.scheduler.breakers.on_change.append(
            lambda t: timeline.append(f"{asyncio.get_running_loop().time() - began:.1f}s {t.after.value}"))
        flapping = asyncio.create_task(flap())
        try:
            for batch in range(64):  # steady traffic through ~16 s of flapping: every down phase sees failures
                await asyncio.to_thread(produce, config, topic, [(None, json.dumps({"n": i}).encode(), [])
                                                                 for i in range(batch * 50, (batch + 1) * 50)])
                await asyncio.sleep(0.25)
            seen = transitions(bridge)
        finally:
            flapping.cancel()
        downstream.down = False
        await wait_until(lambda: len(downstream.succeeded) == n, within=120, what="every record to succeed")
        await await_lag(config, topic, 0, within=60)
    print(f"transitions over ~16 s of flapping: {seen}: {', '.join(timeline)}")
    # Without the doubling, every failed probe re-opens it for 0.5 s again: a dozen openings and more in 16 s of
    # 2 s cycles. With it, each opening waits longer (0.5, 1, 2, 4 s...).
    assert 1 <= seen.get("open", 0) <= 6, seen
    assert await aread_dlq(kafka.bootstrap_servers, f"dlq-{unique}", settle=1.0) == []


async def test_an_operator_holds_a_healthy_queue_open_and_releases_it_and_forgeries_change_nothing(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """`breaker open` (signed) holds a healthy queue: nothing consumed, nothing claimed; `breaker close` releases
    it. With a manual `pause` too, closing the breaker is not enough: the queue runs only when neither holds it.
    Unsigned or badly signed `breaker` commands are refused and change nothing."""
    from bridge.admin.protocol import encode_command
    from bridge.handler_api import HandlerContext
    from bridge.registry import Registry
    from tests.test_admin import RawAdmin, admin_config, one

    handled: list[int] = []
    registry = Registry()

    def ok(ctx: HandlerContext) -> None:
        handled.append(1)

    registry.register("ok", ok)
    topic = f"in-{unique}"
    config = admin_config(kafka, tmp_path, unique, {"q": {"handler": "ok", "sources": [topic]}})
    raw = RawAdmin(config)
    async with running_bridge(config, registry) as bridge:
        breaker = bridge.engine.scheduler.breakers.of("q")

        def forge() -> None:
            _, value, _ = encode_command("breaker", {"queue": "q", "action": "open"}, "mallory", "none",
                                         request_id="forged-unsigned")
            raw.send(value)
            _, value, headers = encode_command("breaker", {"queue": "q", "action": "open"}, "mallory",
                                               config.admin.auth, request_id="forged-bad-sig")  # type: ignore[union-attr]
            raw.send(value.replace(b"mallory", b"alice__"), headers)

        await asyncio.to_thread(forge)
        refusals = {r["request_id"]: r["error"]["type"] for r in await asyncio.to_thread(raw.replies, 2)}
        assert refusals == {"forged-unsigned": "rdq.admin.Unsigned", "forged-bad-sig": "rdq.admin.BadSignature"}
        assert breaker.state == State.CLOSED

        result = await one(config, "breaker", {"queue": "q", "action": "open"})
        assert result["breaker"]["state"] == "open" and "sre@test" in result["breaker"]["forced_by"]
        produce(config, topic, [(None, b"{}", []) for _ in range(30)])
        await asyncio.sleep(3)
        assert handled == [] and await lag(config, topic) == 30  # held: not consumed
        stats = await one(config, "stats", {})
        assert stats["breakers"]["q"]["state"] == "open"

        assert (await one(config, "pause", {"queue": "q"}))["paused"]
        result = await one(config, "breaker", {"queue": "q", "action": "close"})
        assert result["breaker"]["state"] == "closed" and result["paused"]
        await asyncio.sleep(2)
        assert handled == []  # still paused by the operator: neither may hold it for it to run
        await one(config, "resume", {"queue": "q"})
        await wait_until(lambda: len(handled) == 30, within=30, what="the 30 records after the release")
        await await_lag(config, topic, 0)
        assert (await one(config, "breaker", {"queue": "q", "action": "status"}))["breaker"]["state"] == "closed"
