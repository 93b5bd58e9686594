"""Safe bulk redrive through the real CLI and a real broker (SPEC §13): the rate across two instances, the
canary, the loop guard."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from bridge.admin.client import AdminSession, Replies
from bridge.config import BridgeConfig
from bridge.service import Bridge
from tests.conftest import KafkaEnv
from tests.kafka_helpers import produce, read_topic, running_bridge, wait_until
from tests.test_admin import ROOT, admin_config, switch_registry, write

pytestmark = pytest.mark.kafka
QUEUE = {"handler": "switch", "max_attempts": 1}


async def rdq(config: BridgeConfig, tmp_path: Path, *args: str) -> tuple[int, Any, str]:
    """`rdq redrive --config … ARGS --json`: (exit code, the JSON it printed, stderr)."""
    proc = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "bridge.cli", "redrive", "--config", str(write(config, tmp_path)), "--json",
        "--timeout", "30", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else None, proc.stderr


async def counts(*bridges: Bridge) -> dict[str, int]:
    total: dict[str, int] = {}
    for bridge in bridges:
        for status, n in (await bridge.store.counts()).get("q", {}).items():
            total[status] = total.get(status, 0) + n
    return total


async def until_counts(*bridges: Bridge, within: float = 120, **expected: int) -> None:
    async def reached() -> bool:
        now = await counts(*bridges)
        return all(now.get(status, 0) == n for status, n in expected.items())

    await wait_until(reached, within=within, what=f"counts {expected}")


async def test_a_bulk_redrive_holds_its_rate_across_two_instances(kafka: KafkaEnv, tmp_path: Path,
                                                                  unique: str) -> None:
    """2,000 DEAD tasks spread over two bridges, `--rate 400`: each instance redrives its own at a share of the
    rate in proportion to its tasks; the group's pace holds within 10 %, and every task then runs."""
    registry, switch = switch_registry()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    queues = {"q": {**QUEUE, "sources": [f"in-{unique}"]}}
    config_a = admin_config(kafka, tmp_path / "a", unique, queues)
    config_b = admin_config(kafka, tmp_path / "b", unique, queues)
    async with running_bridge(config_a, registry, instance_id="bridge-a") as a, \
            running_bridge(config_b, registry, instance_id="bridge-b") as b:
        produce(config_a, f"in-{unique}", [(f"k{i}".encode(), b"{}", []) for i in range(2000)])
        await until_counts(a, b, DEAD=2000)
        assert (await a.store.counts())["q"]["DEAD"] > 0 and (await b.store.counts())["q"]["DEAD"] > 0
        switch.fixed = True
        began = time.monotonic()
        code, out, err = await rdq(config_a, tmp_path, "--queue", "q", "--rate", "400", "--instances", "2")
        took = time.monotonic() - began
        assert code == 0, err
        summary = out["summary"]
        assert summary["redriven"] == 2000 and summary["refused"] == 0
        assert sorted(r["instance"] for r in out["replies"]) == ["bridge-a", "bridge-b"]
        assert all(r["result"]["count"] > 0 for r in out["replies"])
        assert 360 <= summary["rate"] <= 440, summary  # 2,000 tasks at 400/s: 5 s
        assert took >= 5 * 0.9, took
        await until_counts(a, b, SUCCEEDED=2000)


async def test_the_canary_stops_a_failing_redrive_and_lets_a_passing_one_go_on_behind_the_loop_guard(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    """(The breaker is off here: 30 first deliveries failing together trip it, and then the canary's tasks would
    wait for its probes — one at a time — instead of running together.)"""
    registry, switch = switch_registry()
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"], "max_redrives": 1,
                                                          "breaker": {"enabled": False}}})
    async with running_bridge(config, registry) as bridge:
        produce(config, f"in-{unique}", [(f"k{i}".encode(), b"{}", []) for i in range(30)])
        await until_counts(bridge, DEAD=30)
        # The downstream is still down: the canary's 5 fail, the other 25 are never touched.
        code, out, err = await rdq(config, tmp_path, "--queue", "q", "--canary", "5", "--canary-min", "0.8",
                                   "--canary-wait", "60", "--rate", "1000")
        assert code == 6, err
        canary = out["canary"]
        assert canary["redriven"] == 5 and canary["outcomes"]["failed"] == 5 and not canary["passed"]
        assert out["summary"]["stopped_by_canary"] and out["summary"]["redriven"] == 5
        await until_counts(bridge, DEAD=30)
        tried = {t for t, redrives, _, _ in switch.calls if redrives == 1}
        assert tried == set(canary["tasks"])
        # Fixed: a passing canary, then the rest; the 5 redriven once already meet the loop guard (max_redrives 1).
        switch.fixed = True
        code, out, err = await rdq(config, tmp_path, "--queue", "q", "--canary", "5", "--rate", "1000")
        assert code == 0, err
        assert out["canary"]["passed"] and out["canary"]["outcomes"]["succeeded"] == 5
        assert out["summary"]["redriven"] == 25 and out["summary"]["refused"] == 5
        assert out["summary"]["refused_by_reason"] == {"LoopGuard": 5}
        assert not set(out["canary"]["tasks"]) & set(canary["tasks"])
        await until_counts(bridge, SUCCEEDED=25, DEAD=5)
        # --force passes the guard.
        code, out, err = await rdq(config, tmp_path, "--queue", "q", "--force", "--rate", "1000")
        assert code == 0, err
        assert out["summary"]["redriven"] == 5 and out["summary"]["refused"] == 0
        await until_counts(bridge, SUCCEEDED=30)


@pytest.mark.parametrize("after", [0.0, 0.5], ids=["at-once", "while-it-runs"])
async def test_a_bulk_redrive_is_cancelled_through_the_admin_topic_and_its_answer_still_reaches_the_cli(
        kafka: KafkaEnv, tmp_path: Path, unique: str, after: float) -> None:
    """What Ctrl-C on `rdq redrive --queue` does: a `cancel` of its request id; the redrive's own final answer, read
    while the session waited for the cancel's, is kept for it (the session's other requests' replies are not
    dropped). Sent right behind the redrive, or while it runs (the cancel of a redrive still planning, in the same
    poll, is tested deterministically in test_redrive.py)."""
    registry, _ = switch_registry()
    config = admin_config(kafka, tmp_path, unique, {"q": {**QUEUE, "sources": [f"in-{unique}"],
                                                          "breaker": {"enabled": False}}})
    async with running_bridge(config, registry) as bridge:
        produce(config, f"in-{unique}", [(f"k{i}".encode(), b"{}", []) for i in range(300)])
        await until_counts(bridge, DEAD=300)

        def redrive_then_cancel() -> tuple[Any, Any]:
            session = AdminSession(config, issued_by="sre@test")
            try:
                request_id = str(uuid.uuid4())
                early = session.request("redrive", {"queue": "q", "limit": 1000, "rate": 50}, timeout=after,
                                        instances=1, request_id=request_id)
                assert early.final == []  # still running
                [cancelled] = session.request("cancel", {"request_id": request_id}, timeout=30, instances=1).final
                final = session.collect(Replies(request_id), timeout=30, instances=1)
                return cancelled, final
            finally:
                session.close()

        cancelled, final = await asyncio.to_thread(redrive_then_cancel)
        # The cancel is keyed as the redrive is: on its partition, read after it (keyed by its own request id, it
        # sat on another partition and was read first once in a while: "running" false, and lost).
        records = read_topic(kafka.bootstrap_servers, config.admin.topic, expect=2)
        [(redrive_key, redrive_partition)] = [(m.key(), m.partition()) for m in records
                                              if json.loads(m.value())["command"] == "redrive"]
        assert {(m.key(), m.partition()) for m in records} == {(redrive_key, redrive_partition)}
        assert cancelled["ok"] and cancelled["result"]["running"] and not cancelled["result"]["armed"]
        [reply] = final.final
        assert reply["result"]["interrupted"].startswith("cancelled by sre@test")
        assert 0 <= reply["result"]["count"] < 300 and (after == 0 or reply["result"]["count"] > 0)
        counts = await counts_of(bridge)
        assert counts.get("DEAD", 0) + counts.get("PENDING", 0) + counts.get("IN_FLIGHT", 0) \
            + counts.get("SUCCEEDED", 0) == 300


async def counts_of(bridge: Bridge) -> dict[str, int]:
    return (await bridge.store.counts()).get("q", {})
