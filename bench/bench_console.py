"""The console's pages with many dead tasks (issue 26: every page < 500 ms with 10,000 DEAD tasks across two
instances; `rdq console` up in < 2 s).

    python -m bench.bench_console [--n 10000] [--runs 5]

Two bridges (production defaults, changelog on) share a topic whose handler fails every record permanently: n
DEAD tasks between them. `rdq console` is started as users start it (a child process); the time until it printed
its login URL is its start. Each page is fetched `runs` times through HTTP with the session cookie (the whole
server-side render, every instance's answer awaited). Baseline, in the same run: the admin round trip the
console cannot avoid — one `stats` request through the admin topic as `rdq stats` sends it.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

import handlers  # noqa: F401 - the example handlers (`permanent`)
from bench.bench_admin import KEY, timed_requests
from bench.bench_kafka import PAYLOAD, bench_config, broker, produce
from bench.common import record, rss_mib
from bridge.config import BridgeConfig
from bridge.kafka_clients import ensure_topics
from bridge.model import Status
from bridge.registry import REGISTRY
from bridge.service import Bridge, open_bridge

GOAL_MS = 500.0


def fetch(url: str, cookie: str) -> tuple[float, int]:
    began = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Cookie": cookie}), timeout=30) as response:
        response.read()
        return time.perf_counter() - began, response.status


def start_console(config_path: Path) -> tuple[subprocess.Popen[str], str, str, float]:
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bridge.cli", "console", "--config", str(config_path),
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    started = time.perf_counter() - began
    match = re.match(r"console: (http://127\.0\.0\.1:\d+)/\?token=(\S+)", line)
    if match is None:
        proc.kill()
        raise SystemExit(f"rdq console printed {line!r}")
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        opener.open(f"{match[1]}/?token={match[2]}", timeout=30)
    except urllib.error.HTTPError as e:  # the 303 that sets the cookie
        cookie = e.headers["Set-Cookie"].split(";")[0]
    return proc, match[1], cookie, started


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


async def two_bridges(config: BridgeConfig, tmp: Path) -> tuple[list[Bridge], list[asyncio.Task[None]],
                                                                 asyncio.Event]:
    stop = asyncio.Event()
    bridges, runners = [], []
    for name in ("a", "b"):
        own = config.model_copy(update={"store": config.store.model_copy(update={"path": tmp / f"{name}.db"})})
        bridge = await open_bridge(own, REGISTRY, instance_id=f"bench-{name}")
        bridges.append(bridge)
        runners.append(asyncio.create_task(bridge.run(stop)))
    return bridges, runners, stop


async def dead_count(bridges: list[Bridge]) -> int:
    total = 0
    for bridge in bridges:
        total += (await bridge.store.counts()).get("q", {}).get("DEAD", 0)
    return total


async def main(n: int, runs: int) -> None:
    with broker() as bootstrap, tempfile.TemporaryDirectory(dir=".") as tmp:
        unique = bench_config(bootstrap, Path(tmp), {"handler": "permanent"}).kafka.group_id
        config = bench_config(bootstrap, Path(tmp), {"handler": "permanent"},
                              admin={"topic": f"admin-{unique}", "reply_topic": f"replies-{unique}",
                                     "auth": {"keys": {"k1": KEY}}})
        ensure_topics(config)
        bridges, runners, stop = await two_bridges(config, Path(tmp))
        await asyncio.sleep(8)  # both in the group, its partitions shared, before the records arrive
        produce(bootstrap, config.queues["q"].sources[0], n, PAYLOAD)
        while await dead_count(bridges) < n:  # noqa: ASYNC110 - the setup
            await asyncio.sleep(0.5)
        spread = [(await b.store.counts()).get("q", {}).get("DEAD", 0) for b in bridges]
        [task] = await bridges[0].store.list_tasks("q", Status.DEAD, 1)
        config_path = Path(tmp) / "console.yaml"
        config_path.write_text(yaml.safe_dump(config.file_tree()))
        proc, base, cookie, started = await asyncio.to_thread(start_console, config_path)
        try:
            pages = {"overview": "/", "dead letters": "/dead", "dead letters, filtered": "/dead?queue=q&text=refuse",
                     "task": f"/task/{task.id}", "audit": "/audit", "redrive form": "/redrive"}
            took: dict[str, list[float]] = {name: [] for name in pages}
            for path in pages.values():  # once to warm (the first request assigns the reply partitions)
                await asyncio.to_thread(fetch, base + path, cookie)
            for _ in range(runs):
                for name, path in pages.items():
                    seconds, status = await asyncio.to_thread(fetch, base + path, cookie)
                    assert status == 200, (name, status)
                    took[name].append(seconds)
            console_rss = rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(15)
        baseline = await asyncio.to_thread(timed_requests, config, {"stats": ("stats", {})}, runs)
        stop.set()
        for runner in runners:
            await runner
        for bridge in bridges:
            await bridge.store.close()
    lines = [f"tasks: {n} DEAD across 2 instances ({spread[0]} + {spread[1]}; a permanent handler, production "
             f"defaults, changelog on); each page {runs} times over HTTP with the session cookie",
             f"rdq console start (until it printed its URL): {started * 1000:.0f} ms (goal < 2000 ms); "
             f"RSS {console_rss:.0f} MiB"]
    for name, values in took.items():
        median = statistics.median(values) * 1000
        lines.append(f"page {name}: median {median:.0f} ms, max {max(values) * 1000:.0f} ms (goal < {GOAL_MS:.0f} ms: "
                     f"{'met' if max(values) * 1000 < GOAL_MS else 'MISSED'})")
    lines.append(f"baseline, one `stats` through the admin topic as `rdq stats` sends it (a new session): median "
                 f"{statistics.median(baseline['stats']) * 1000:.0f} ms")
    record("console pages with many dead tasks (rdq console, two instances)", lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.n, arguments.runs))
