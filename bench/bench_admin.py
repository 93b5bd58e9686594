"""How fast the `rdq` CLI answers with many dead tasks (issue 17: `get`, `list`, `stats` in < 1 s at 10,000), and
how fast a bulk redrive goes when asked to (goal: >= 2,000 tasks/s).

    python -m bench.bench_admin [--n 10000] [--runs 5] [--rate 5000]

One bridge (production defaults, changelog on) whose queue's handler fails every record permanently: n DEAD
tasks (published to the DLQ). Then each command goes through the admin topic as `rdq` sends it (signed, the
answer awaited; the session ends once every instance of the group answered), several times; the baseline is
the same question asked of the store in-process, in the same run.

Then `rdq redrive --queue q --rate R` (the real CLI, a child process) redrives all n at once while the bridge runs
them again (they die again: the handler still fails); its pace is the summary's (tasks redriven / the longest
instance's seconds). Baseline, once they are all DEAD again: the same redrive straight on the store, unpaced,
in batches as the bridge makes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

import handlers  # noqa: F401 - the example handlers (`permanent`)
from bench.bench_kafka import PAYLOAD, bench_config, broker, produce
from bench.common import record
from bridge.admin.client import AdminSession
from bridge.config import BridgeConfig
from bridge.kafka_clients import ensure_topics
from bridge.model import Status
from bridge.registry import REGISTRY
from bridge.service import Bridge, open_bridge

KEY = "a-benchmark-secret-of-32-bytes-or-more"


def timed_requests(config: BridgeConfig, asks: dict[str, tuple[str, dict[str, Any]]], runs: int
                   ) -> dict[str, list[float]]:
    """Each command `runs` times, as the CLI sends it (a session per command, as each `rdq` call is)."""
    took: dict[str, list[float]] = {name: [] for name in asks}
    for _ in range(runs):
        for name, (command, args) in asks.items():
            began = time.perf_counter()
            session = AdminSession(config, issued_by="bench")
            try:
                replies = session.request(command, args, timeout=30).final
            finally:
                session.close()
            took[name].append(time.perf_counter() - began)
            assert replies and all(r["ok"] for r in replies), replies
    return took


async def in_store(bridge: Bridge, task_id: str, runs: int) -> dict[str, list[float]]:
    calls = {"stats": lambda: bridge.store.counts(), "list": lambda: bridge.store.list_tasks("q", Status.DEAD, 100),
             "get": lambda: bridge.store.get(task_id)}
    took: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            began = time.perf_counter()
            await call()
            took[name].append(time.perf_counter() - began)
    return took


async def until_dead(bridge: Bridge, n: int) -> None:
    while (await bridge.store.counts()).get("q", {}).get("DEAD", 0) < n:  # noqa: ASYNC110 - polling the store
        await asyncio.sleep(0.5)


async def redrive_rates(bridge: Bridge, config: BridgeConfig, tmp: Path, n: int, rate: float) -> list[str]:
    path = tmp / "cli.yaml"
    path.write_text(yaml.safe_dump(config.file_tree()))
    proc = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "bridge.cli", "redrive", "--config", str(path), "--queue", "q", "--rate", str(rate),
        "--json", "--timeout", "60"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["summary"]
    assert summary["redriven"] == n, summary
    await until_dead(bridge, n)
    ids = [task_id for task_id, _ in await bridge.store.dead_candidates("q", limit=n)]
    began = time.perf_counter()
    for start in range(0, n, 250):  # the bridge's batch at 5,000/s
        await bridge.store.redrive_many(ids[start : start + 250], int(time.time() * 1000), max_redrives=None)
    ceiling = n / (time.perf_counter() - began)
    await until_dead(bridge, n)
    return [f"rdq redrive --queue q --rate {rate:g} of {n} DEAD tasks (while the bridge runs them again): "
            f"{summary['rate']:.0f} tasks/s over {summary['seconds']:.1f} s  (goal >= 2000/s); the store's own "
            f"redrive, unpaced, same batches: {ceiling:.0f} tasks/s"]


async def main(n: int, runs: int, rate: float) -> None:
    with broker() as bootstrap, tempfile.TemporaryDirectory(dir=".") as tmp:
        base = bench_config(bootstrap, Path(tmp), {"handler": "permanent"})
        unique = base.kafka.group_id
        config = bench_config(bootstrap, Path(tmp), {"handler": "permanent"},
                              admin={"topic": f"admin-{unique}", "reply_topic": f"replies-{unique}",
                                     "auth": {"keys": {"k1": KEY}}})
        ensure_topics(config)
        produce(bootstrap, config.queues["q"].sources[0], n, PAYLOAD)
        bridge = await open_bridge(config, REGISTRY, instance_id="bench")
        stop = asyncio.Event()
        runner = asyncio.create_task(bridge.run(stop))
        began = time.perf_counter()
        while (await bridge.store.counts()).get("q", {}).get("DEAD", 0) < n:  # noqa: ASYNC110 - the setup
            await asyncio.sleep(0.5)
        setup = time.perf_counter() - began
        [task] = await bridge.store.list_tasks("q", Status.DEAD, 1)
        asks = {"stats": ("stats", {}), "list": ("list", {"queue": "q", "status": "DEAD", "limit": 100}),
                "get": ("get", {"task_id": task.id})}
        await asyncio.to_thread(timed_requests, config, asks, 1)  # topics, metadata, the group: warmed once
        cli = await asyncio.to_thread(timed_requests, config, asks, runs)
        store = await in_store(bridge, task.id, runs)
        redrive = await redrive_rates(bridge, config, Path(tmp), n, rate)
        stop.set()
        await runner
        await bridge.store.close()
    lines = [f"tasks: {n} DEAD (a permanent handler, production defaults, changelog on), made in {setup:.0f} s; "
             f"{runs} runs of each command, as `rdq` sends it (a new session each, signed, ended when every "
             "instance of the group answered)"]
    for name in asks:
        lines.append(f"rdq {name}: median {statistics.median(cli[name]) * 1000:.0f} ms, max "
                     f"{max(cli[name]) * 1000:.0f} ms  (goal < 1000 ms); the same question of the store "
                     f"in-process: median {statistics.median(store[name]) * 1000:.1f} ms")
    record("admin answers with many dead tasks (rdq get, list, stats through the admin topic)", lines)
    record("bulk redrive rate (rdq redrive --queue --rate)", redrive)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rate", type=float, default=5000.0)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.n, arguments.runs, arguments.rate))
