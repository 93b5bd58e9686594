"""`engine.processes`: the bridge on every core (issue 25), each row against a baseline measured in the same run.

    python -m bench.bench_processes failure [--n 20000] [--runs 3]   # every first attempt fails: processes 2 vs 1
    python -m bench.bench_processes happy   [--n 100000] [--runs 3]  # ok handler: processes 2 vs a bare loop of 2
    python -m bench.bench_processes restore [--n 1000000] [--runs 3] # a restart restoring 12 partitions: 2 vs 1
    python -m bench.bench_processes ready   [--runs 3]               # a restart's time to ready, 24 partitions
    python -m bench.bench_processes all

Each bridge is `rdq run --processes P` as users run it (a child process; production defaults, changelog on),
watched from outside through its `/metrics`, on a fresh consumer group and store each run. The rate is the
steady state: from the first record counted to the n-th (group join and restore apart, reported as wall).
RSS: each bridge process (every child, and the supervisor) at the end of its run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from confluent_kafka import Consumer
from prometheus_client.parser import text_string_to_metric_families

from bench.bench_changelog import fill_changelog, in_a_child
from bench.bench_kafka import PARTITIONS, PAYLOAD, _spread, bench_config, broker, produce
from bench.common import NO_BREAKER, NO_BREAKER_NOTE, SMOKE, BenchTimeout, record, rss_mib
from bridge.config import BridgeConfig, load_config
from bridge.kafka_clients import FETCH_QUEUE_BACKOFF_MS, ensure_topics
from localkafka.broker import free_port

ROOT = Path(__file__).resolve().parent.parent
FAILING = b'{"fail": 99, "pad": "' + b"x" * 1000 + b'"}'  # ~1 KB; the flaky example handler fails it every time
WITHIN = 600.0


def _metric_sum(port: int, family: str, **labels: str) -> float:
    """The sum over every process of a family's `_total` samples with these labels (0 until it answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == family for s in f.samples
               if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def _pids(port: int, bridge: subprocess.Popen[bytes]) -> list[int]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            children = json.loads(response.read()).get("children", {})
    except OSError:
        children = {}
    return [bridge.pid, *(c["pid"] for c in children.values() if c.get("pid"))]


def _own_children(pid: int) -> list[int]:
    """The processes `pid` started (a bridge's helper, a supervisor's children), from /proc."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _rss_text(run: BridgeRun) -> str:
    """Each process's RSS; a helper process's after its bridge's in parentheses."""
    return "/".join(f"{s:.0f}" + (f" (+{h:.0f})" if h else "") for s, h in zip(run.rss, run.helpers_rss, strict=True))


def _cpu_busy() -> tuple[float, float]:
    """The machine's busy and total CPU time so far (jiffies, every core), from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


# Seconds after /readyz answers 200: every child joined and the group's assignment is final (a smoke run only
# checks that the bench runs).
SETTLE = 2.0 if SMOKE else 8.0
# How often a run looks at the bridge's /metrics. Each look costs the bridge: under `processes: 2` the supervisor
# merges its children's pages (2.3 ms of CPU a look, each child 0.45 ms; one process 0.5 ms), and at a look every
# 50 ms that was 3 % of this 2-core machine under two processes against 1 % under one (bench/RESULTS.md,
# diagnostic, 2026-12-06 23:05-23:38 UTC). A scraper in production looks every 15-60 s.
POLL = 0.25


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


class BridgeRun(NamedTuple):
    rate: float  # steady records/s
    wall: float  # s from the first record produced
    rss: list[float]  # MiB, each process: the supervisor, then the children
    helpers_rss: list[float]  # MiB, each process's own helper processes (the changelog's outbox read), summed
    busy: float  # the machine's CPU busy share during the steady phase
    cores: list[float]  # each process's CPU during the steady phase, in cores: the supervisor, then the children
    bench_cores: float  # this process's (the producer's) meanwhile


def _cpu_seconds(pid: int, waited: bool = False) -> float:
    """A process's CPU time so far (user + system, every thread), from /proc; `waited`: with that of its children
    it waited for (a finished decoding process). 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11 : 15 if waited else 13]) / os.sysconf("SC_CLK_TCK")


def _start(config: BridgeConfig, tmp: Path, processes: int, topic: str, fresh_group: bool = True,
           ) -> tuple[subprocess.Popen[bytes], int, Path]:
    """`rdq run --processes P` on `topic` with a fresh store, and a fresh consumer group unless not `fresh_group`
    (the group names the changelog); its port and its log (stderr)."""
    unique = uuid.uuid4().hex[:6]
    port = free_port()
    tree = config.file_tree()
    tree["queues"]["q"]["sources"] = [topic]
    if fresh_group:
        tree["kafka"]["group_id"] = f"{config.kafka.group_id}-{unique}"
    tree["store"]["path"] = str(tmp / f"{unique}.db")
    tree.setdefault("telemetry", {})["port"] = port
    path = tmp / f"{unique}.yaml"
    path.write_text(yaml.safe_dump(tree))
    ensure_topics(load_config(path))
    log = tmp / f"{unique}.log"
    bridge = subprocess.Popen([sys.executable, "-m", "bridge.cli", "run", "--config", str(path), "--processes",
                               str(processes)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    return bridge, port, log


def _stop(bridge: subprocess.Popen[bytes]) -> None:
    bridge.send_signal(signal.SIGTERM)
    try:
        bridge.wait(60)
    except subprocess.TimeoutExpired:
        bridge.kill()


def run_bridge(config: BridgeConfig, tmp: Path, processes: int, n: int, payload: bytes, family: str,
               **labels: str) -> BridgeRun:
    """`rdq run --processes P` on a fresh topic, group and store: once it is ready and its group settled, n
    records are produced, and it runs until `family{labels}` counts n."""
    topic = f"{config.queues['q'].sources[0]}-{uuid.uuid4().hex[:6]}"
    bridge, port, log = _start(config, tmp, processes, topic)
    try:
        _wait_for(lambda: _ready(port), bridge, f"rdq run --processes {processes} ready (its log: {log})")
        time.sleep(SETTLE)
        began = time.perf_counter()
        producer = threading.Thread(target=produce, args=(config.kafka.bootstrap_servers, topic, n, payload))
        producer.start()
        first: tuple[float, float, tuple[float, float]] | None = None
        below_n: tuple[float, float] | None = None  # the last look that counted fewer than n: (time, count)
        cpu_before: dict[int, float] = {}
        while True:
            counted = _metric_sum(port, family, **labels)
            now = time.perf_counter()
            if counted and first is None:
                first = (now, counted, _cpu_busy())
                cpu_before = {pid: _cpu_seconds(pid) for pid in [*_pids(port, bridge), os.getpid()]}
            if counted >= n and first is not None:
                break
            if first is not None:
                below_n = (now, counted)
            if now - began > WITHIN or bridge.poll() is not None:
                raise BenchTimeout(f"rdq run --processes {processes} counted {counted:.0f} of {n} {family} within "
                                   f"{now - began:.0f} s (exit {bridge.poll()}; its log: {log})")
            time.sleep(POLL)
        cores = {pid: (_cpu_seconds(pid) - before) / max(now - first[0], 1e-9) for pid, before in cpu_before.items()}
        producer.join()
        busy, total = (b - a for a, b in zip(first[2], _cpu_busy(), strict=True))
        steady = _steady_rate(first[:2], below_n, (now, n), began)
        pids = _pids(port, bridge)
        helpers = [sum(rss_mib(h) for h in _own_children(pid) if h not in pids) for pid in pids]
        return BridgeRun(steady, now - began, [rss_mib(pid) for pid in pids], helpers, busy / total if total else 0.0,
                         [cores.get(pid, 0.0) for pid in pids], cores.get(os.getpid(), 0.0))
    finally:
        _stop(bridge)


def _steady_rate(first: tuple[float, float], below_n: tuple[float, float] | None, last: tuple[float, float],
                 began: float) -> float:
    """Records/s between two looks at the count, both taken while it rose: the first that counted any and the
    last that counted fewer than n (the look that counted n came up to POLL after the n-th record). A run too
    short for two such looks: from the first look to the last; one look saw all n: the wall rate."""
    (t0, c0), (t1, c1) = first, last
    if c0 >= c1:
        return c1 / (t1 - began)
    if below_n is not None and below_n[1] > c0:
        t1, c1 = below_n
    return (c1 - c0) / (t1 - t0)


def _wait_for(predicate: Any, bridge: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + WITHIN
    while not predicate():
        if time.monotonic() > deadline or bridge.poll() is not None:
            raise BenchTimeout(f"timed out waiting for {what} (exit {bridge.poll()})")
        time.sleep(0.1)


# ---- the failure path: processes 2 vs 1 ------------------------------------------------------------------------


def bench_failure(bootstrap: str, n: int, runs: int) -> None:
    rates: dict[int, list[float]] = {1: [], 2: []}
    busy: dict[int, list[float]] = {1: [], 2: []}
    ratios: list[float] = []
    rss: list[str] = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config = bench_config(bootstrap, Path(tmp), {"handler": "flaky", "max_attempts": 5,
                                                     "backoff": {"kind": "fixed", "base": "1h"}, **NO_BREAKER})
        for _ in range(runs):
            for processes in (1, 2):
                run = run_bridge(config, Path(tmp), processes, n, FAILING, "rdq_tasks_created", status="PENDING")
                rates[processes].append(run.rate)
                busy[processes].append(run.busy)
                rss.append(f"{processes}: " + _rss_text(run))
            ratios.append(rates[2][-1] / rates[1][-1])
    record("failure path on every core: processes 2 vs 1 (every first attempt fails and is stored durably)", [
        f"records: {n} x 1 KB, {PARTITIONS} partitions; each becomes a PENDING task with its first attempt; {runs} "
        "runs, each: `rdq run --processes 1`, then `--processes 2`, on a fresh topic, group and store; the "
        f"records produced once it is ready and its group settled ({SETTLE:.0f} s)",
        "production defaults (changelog on, synchronous=FULL) but the " + NO_BREAKER_NOTE,
        f"baseline, processes 1: {_spread(rates[1])} records/s",
        f"processes 2: {_spread(rates[2])} records/s; ratio to 1 process min/median/max {_spread(ratios, '.2f')}  "
        "(goal >= 1.6)",
        f"the machine's CPU busy during the steady phase (every core; the broker runs here too): processes 1 "
        f"{_spread([b * 100 for b in busy[1]])} %, processes 2 {_spread([b * 100 for b in busy[2]])} %",
        f"RSS MiB per process (processes: supervisor/children; in parentheses a bridge's helper process, the "
        f"changelog's outbox read, where one ran): {'; '.join(rss)}",
    ])


# ---- the happy path: processes 2 vs a bare loop of 2 members ----------------------------------------------------


def _bare_member(bootstrap: str, topic: str, group: str, n: int, out: Any) -> None:
    """One member of a bare group: consume, run nothing but a JSON decode, store offsets; says when it has its
    assignment, then reports the time of its first and last record (it stops after 3 s without one, or at n)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                         "enable.auto.offset.store": False, "partition.assignment.strategy": "cooperative-sticky",
                         "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS})
    consumer.subscribe([topic], on_assign=lambda c, partitions: out.put(("assigned", len(partitions))))
    seen, first, last, idle_since = 0, 0.0, 0.0, time.monotonic()
    while seen < n and time.monotonic() - idle_since < (3.0 if seen else WITHIN):
        messages = [m for m in consumer.consume(500, 0.2) if m.error() is None]
        for msg in messages:
            json.loads(msg.value())
        if messages:
            now = time.perf_counter()
            first = first or now
            last, seen, idle_since = now, seen + len(messages), time.monotonic()
            consumer.store_offsets(messages[-1])
    consumer.close()
    out.put(("done", (seen, first, last)))


def bare_pair(config: BridgeConfig, n: int) -> tuple[float, float]:
    """Two bare members in two processes of one group on a fresh topic; once both hold partitions and the group
    settled, n records are produced (as for the bridge). Returns (records/s from the first record of either to
    the last, the machine's CPU busy share meanwhile)."""
    bootstrap = config.kafka.bootstrap_servers
    topic = f"{config.queues['q'].sources[0]}-bare-{uuid.uuid4().hex[:6]}"
    ensure_topics(config.model_copy(update={"queues": {"q": config.queues["q"].model_copy(
        update={"sources": [topic]})}}))
    context = multiprocessing.get_context("spawn")
    queue: Any = context.Queue()
    members = [context.Process(target=_bare_member, args=(bootstrap, topic, f"bare-{topic}", n, queue))
               for _ in range(2)]
    for member in members:
        member.start()
    events: list[tuple[str, Any]] = []
    while sum(1 for kind, count in events if kind == "assigned" and count) < 2:
        events.append(queue.get(timeout=WITHIN))
    time.sleep(SETTLE)
    before = _cpu_busy()
    produce(bootstrap, topic, n)
    reports = []
    while len(reports) < 2:
        kind, report = queue.get(timeout=WITHIN)
        if kind == "done":
            reports.append(report)
    busy, total = (b - a for a, b in zip(before, _cpu_busy(), strict=True))
    for member in members:
        member.join(30)
    seen = sum(r[0] for r in reports)
    if seen < n:
        raise BenchTimeout(f"the bare pair consumed {seen} of {n} records")
    return n / (max(r[2] for r in reports) - min(r[1] for r in reports if r[1])), busy / total if total else 0.0


def bench_happy(bootstrap: str, n: int, runs: int) -> None:
    bare: list[float] = []
    bridge: list[float] = []
    busy: list[float] = []
    bare_busy: list[float] = []
    ratios: list[float] = []
    rss: list[str] = []
    cores: list[str] = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config = bench_config(bootstrap, Path(tmp), {"handler": "ok"})
        for _ in range(runs):
            rate, cpu = bare_pair(config, n)
            bare.append(rate)
            bare_busy.append(cpu)
            run = run_bridge(config, Path(tmp), 2, n, PAYLOAD, "rdq_attempts", outcome="SUCCESS")
            busy.append(run.busy)
            bridge.append(run.rate)
            ratios.append(run.rate / bare[-1])
            rss.append(_rss_text(run))
            cores.append("/".join(f"{c:.2f}" for c in run.cores) + f" (bench {run.bench_cores:.2f})")
    record("happy path on every core: processes 2 vs a bare loop of 2 members", [
        f"records: {n} x 1 KB, {PARTITIONS} partitions; {runs} runs, each: two bare confluent-kafka members (two "
        "processes, one group: batch consume, JSON decode, store_offsets), then `rdq run --processes 2` with the "
        "ok handler (production defaults, changelog on); each on a fresh topic and group, the records produced "
        f"once every member holds partitions and the group settled ({SETTLE:.0f} s)",
        f"baseline, the bare pair: {_spread(bare)} records/s",
        f"bridge, processes 2: {_spread(bridge)} records/s; ratio min/median/max {_spread(ratios, '.2f')}  "
        "(goal >= 0.8)",
        f"the machine's CPU busy (every core; the broker and the producer run here too): the bare pair "
        f"{_spread([b * 100 for b in bare_busy])} %, the bridge {_spread([b * 100 for b in busy])} %",
        f"RSS MiB per bridge process (supervisor/children; in parentheses a helper process, where one ran): "
        f"{'; '.join(rss)}",
        "CPU of each bridge process in the steady phase, in cores (supervisor/children; and the bench's own "
        f"process, the producer's; the broker has the rest): {'; '.join(cores)}",
    ])


# ---- a restart's restore: 1M tasks over 12 partitions, processes 2 vs 1 ------------------------------------------


_RESTORED = re.compile(r"^restored (\S+): (\d+) tasks from \d+ changelog records in ([\d.]+)s")


class RestoreRun(NamedTuple):
    rate: float  # tasks/s over the restore's span: the first partition's start to the last one's end
    span: float  # s
    ready: float  # s from `rdq run` to /readyz answering 200: every partition restored (the unavailability)
    cpu: float  # us a task, every bridge process and its helpers (the decoding process) from its start to ready
    peak_rss: list[float]  # MiB, each bridge process's peak (VmHWM): the supervisor, then the children
    again: int  # partitions restored again (the group moved them while the bridge started)
    settled: float  # s from the first log line to the last process's first partitions (the group formed)
    own: list[float]  # tasks/s of each process over its own restores' span (its first start to its last end)


class _Log(NamedTuple):
    restores: dict[str, list[tuple[float, float, int, str]]]  # partition: each restore's (start, end, tasks, child)
    first_line: float
    first_assigned: dict[str, float]  # child (or "" for one process): when it was first assigned partitions
    assigned: dict[str, float]  # partition: when it was last assigned (to whichever process)


def _read_log(log: Path) -> _Log:
    """A bridge's JSON log lines: each partition's restores by its `restored …` lines (end: the line's time; more
    than one where the group moved it meanwhile), and when each process was first assigned partitions."""
    found = _Log({}, 0.0, {}, {})
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            at = dt.datetime.strptime(entry["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()
            found = found._replace(first_line=found.first_line or at)
            msg, child = entry.get("msg", ""), str(entry.get("child", ""))
            if match := _RESTORED.match(msg):
                found.restores.setdefault(match[1], []).append((at - float(match[3]), at, int(match[2]), child))
            elif msg.startswith("assigned ['"):
                found.first_assigned.setdefault(child, at)
                found.assigned.update(dict.fromkeys(re.findall(r"'([^']+)'", msg), at))
    return found


def _restored_all(log: Path, n: int, processes: int) -> bool:
    """Every process holds partitions (the group formed) and each partition was restored since it was last
    assigned, n tasks in all (a partition the group moved is unavailable again until its new owner restored it)."""
    found = _read_log(log)
    if len(found.first_assigned) < processes:
        return False
    latest = {p: max(done) for p, done in found.restores.items()}
    return (all(p in latest and latest[p][1] >= at for p, at in found.assigned.items())
            and sum(one[2] for one in latest.values()) == n)


def _restored_within(bridge: subprocess.Popen[bytes], port: int, log: Path, n: int, processes: int,
                     every: float = 0.02) -> float:
    """Seconds until /readyz answers 200 (it does before the group assigned anything), every process holds
    partitions and every task is restored; looked at `every` seconds (the log read whole each time)."""
    began = time.perf_counter()
    while not (_ready(port) and _restored_all(log, n, processes)):
        if time.perf_counter() - began > WITHIN or bridge.poll() is not None:
            raise BenchTimeout(f"rdq run --processes {processes} did not restore {n} tasks within {WITHIN:.0f} s "
                               f"(exit {bridge.poll()}; its log: {log})")
        time.sleep(every)
    return time.perf_counter() - began


def restore_run(config: BridgeConfig, tmp: Path, processes: int, n: int, partitions: int) -> tuple[RestoreRun, int]:
    """A fresh group's changelog filled with n tasks over `partitions`, then `rdq run --processes P` started on a
    fresh store beside it: it restores every task before its partitions are served. Returns the run and the size
    of a changelog record."""
    tree = config.file_tree()
    tree["kafka"]["group_id"] = f"{config.kafka.group_id}-{uuid.uuid4().hex[:6]}"  # the changelog's name carries it
    config = BridgeConfig.model_validate(tree)
    topic = config.queues["q"].sources[0]
    ensure_topics(config)
    # Open tasks waiting for their next attempt (an hour away), as a restart finds them: a restored task due at once
    # would be run as soon as its partition is ready, beside the others' restores.
    size = in_a_child(fill_changelog, config.kafka.bootstrap_servers, topic, config.changelog_topic(topic), n, 5,
                      partitions, int(time.time() * 1000))
    began = time.perf_counter()
    bridge, port, log = _start(config, tmp, processes, topic, fresh_group=False)
    try:
        _restored_within(bridge, port, log, n, processes, every=0.1)
        ready = time.perf_counter() - began  # from before the config and topics were made, as this row always was
        pids = _pids(port, bridge)
        cpu = sum(_cpu_seconds(pid, waited=True) for pid in pids)
        peak = [rss_mib(pid, peak=True) for pid in pids]
    finally:
        _stop(bridge)
    found = _read_log(log)
    every = [one for done in found.restores.values() for one in done]
    span = max(end for _, end, _, _ in every) - min(start for start, _, _, _ in every)
    own = []
    for child in sorted({c for *_, c in every}):
        mine = [one for one in every if one[3] == child]
        tasks = sum(max(done)[2] for done in found.restores.values() if max(done)[3] == child)
        own.append(tasks / (max(e for _, e, _, _ in mine) - min(b for b, _, _, _ in mine)))
    settled = max(found.first_assigned.values()) - found.first_line
    return RestoreRun(n / span, span, ready, cpu / n * 1e6, peak, len(every) - len(found.restores), settled,
                      own), size


def _ok_config(bootstrap: str, tmp: Path, partitions: int) -> BridgeConfig:
    """The `ok` handler's queue on topics of `partitions`, in a group of its own."""
    return bench_config(bootstrap, tmp, {"handler": "ok"},
                        kafka={"bootstrap_servers": bootstrap, "group_id": f"bench-{uuid.uuid4().hex[:8]}",
                               "topic_partitions": partitions})


def bench_restore(bootstrap: str, n: int, runs: int, partitions: int = 12) -> None:
    results: dict[int, list[RestoreRun]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config = _ok_config(bootstrap, Path(tmp), partitions)
        for _ in range(runs):
            for processes in (1, 2):
                run, size = restore_run(config, Path(tmp), processes, n, partitions)
                results[processes].append(run)
    one, two = results[1], results[2]
    record(f"a restart's restore on every core: processes 2 vs 1, {partitions} partitions", [
        f"tasks: {n} over {partitions} partitions, 5 attempts each, ~{size / 1024:.1f} KB per changelog record; "
        f"{runs} runs, each: `rdq run --processes 1`, then `--processes 2`, each on a fresh store, group and "
        "changelog (filled before it starts; production defaults, synchronous=FULL): it restores every task before "
        "its partitions are served",
        f"restore, processes 1 (baseline): {_spread([r.rate for r in one])} tasks/s",
        f"restore, processes 2: {_spread([r.rate for r in two])} tasks/s; ratio to 1 process min/median/max "
        f"{_spread([b.rate / a.rate for a, b in zip(one, two, strict=True)], '.2f')}  (goal >= 50000 tasks/s)",
        "  (a restore's span: its first partition's start to its last one's end, by the bridge's `restored` log lines; "
        f"partitions restored again as the group formed: processes 1 {[r.again for r in one]}, processes 2 "
        f"{[r.again for r in two]})",
        "each child's own rate, processes 2 (its tasks over its own restores' span): "
        + "; ".join("/".join(f"{x:.0f}" for x in r.own) for r in two) + " tasks/s",
        "the group formed (the last process's first partitions), s after the bridge's first log line: processes 1 "
        f"{_spread([r.settled for r in one], '.1f')}, processes 2 {_spread([r.settled for r in two], '.1f')} (this "
        "broker's group.initial.rebalance.delay.ms is 0: the first child to join gets every partition, and the "
        "second its share only after a cooperative rebalance, two rounds each noticed at a heartbeat)",
        f"unavailable, `rdq run` to /readyz 200 and every task restored: processes 1 "
        f"{_spread([r.ready for r in one], '.1f')} s, processes 2 {_spread([r.ready for r in two], '.1f')} s (start, "
        "group join and restore)",
        f"CPU a task, every bridge process and its decoding process: processes 1 {_spread([r.cpu for r in one], '.1f')}"
        f" us, processes 2 {_spread([r.cpu for r in two], '.1f')} us ({os.cpu_count()} cores, the broker on them too)",
        "peak RSS MiB per bridge process (processes 2: supervisor/children): "
        + "; ".join("/".join(f"{m:.0f}" for m in r.peak_rss) for r in one + two),
    ])


# ---- a restart's time to ready: processes 2, dynamic and static members -----------------------------------------

READY_PARTITIONS = 24
READY_PER_PARTITION = 5
MEMBERSHIPS = ("dynamic", "static")


class ReadyRun(NamedTuple):
    first: float  # s, `rdq run` to every process assigned and every task restored: the group new
    again: float  # the same after a stop and a start onto fresh stores: the group the one it left


def ready_run(config: BridgeConfig, tmp: Path, processes: int, membership: str) -> ReadyRun:
    """A fresh group's changelog holding 5 open tasks (an hour from due) of each of 24 partitions; `rdq run
    --processes P` started on a fresh store until ready, stopped (SIGTERM), and started again on a fresh store (a
    pod replaced, its disk gone) until ready. `static`: each process a static member (`kafka.consumer`'s
    `group.instance.id`, suffixed `-<i>` per child), as deploy/kubernetes runs them."""
    tree = config.file_tree()
    unique = uuid.uuid4().hex[:6]
    tree["kafka"]["group_id"] = f"{config.kafka.group_id}-{unique}"
    if membership == "static":
        tree["kafka"].setdefault("consumer", {})["group.instance.id"] = f"bench-ready-{unique}"
    config = BridgeConfig.model_validate(tree)
    topic = config.queues["q"].sources[0]
    ensure_topics(config)
    n = READY_PARTITIONS * READY_PER_PARTITION
    in_a_child(fill_changelog, config.kafka.bootstrap_servers, topic, config.changelog_topic(topic), n, 5,
               READY_PARTITIONS, int(time.time() * 1000))
    times = []
    for _ in range(2):
        bridge, port, log = _start(config, tmp, processes, topic, fresh_group=False)
        try:
            times.append(_restored_within(bridge, port, log, n, processes))
        finally:
            _stop(bridge)
    return ReadyRun(*times)


def bench_ready(bootstrap: str, runs: int) -> None:
    results: dict[tuple[int, str], list[ReadyRun]] = {}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        config = _ok_config(bootstrap, Path(tmp), READY_PARTITIONS)
        for _ in range(runs):
            for processes in (1, 2):
                for membership in MEMBERSHIPS:
                    run = ready_run(config, Path(tmp), processes, membership)
                    results.setdefault((processes, membership), []).append(run)
    lines = [
        f"{READY_PARTITIONS} partitions x {READY_PER_PARTITION} open tasks (5 attempts each) in the changelog; {runs} "
        "runs, each: `rdq run --processes P` on a fresh group and store until ready, stopped (SIGTERM), started again "
        "on a fresh store (a pod replaced, its disk gone); production defaults; dynamic members, then static ones "
        "(`group.instance.id` in kafka.consumer, as deploy/kubernetes sets it)",
        "ready: `rdq run` to /readyz 200, every process holding partitions and every task restored; this broker's "
        "group.initial.rebalance.delay.ms is 0",
    ]
    for (processes, membership), runs_of in results.items():
        label = "baseline, " if processes == 1 else ""
        lines.append(f"{label}processes {processes}, {membership} members: the group new "
                     f"{_spread([r.first for r in runs_of], '.2f')} s; after the restart "
                     f"{_spread([r.again for r in runs_of], '.2f')} s" + ("  (goal < 2 s)" if processes == 2 else ""))
    record("a restart's time to ready on every core: processes 2, dynamic and static members", lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["failure", "happy", "restore", "ready", "all"])
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.environ.pop("RDQ_CHILD", None)
    with broker() as bootstrap:
        if args.which in ("failure", "all"):
            bench_failure(bootstrap, args.n or 20_000, args.runs)
        if args.which in ("happy", "all"):
            bench_happy(bootstrap, args.n or 100_000, args.runs)
        if args.which in ("restore", "all"):
            bench_restore(bootstrap, args.n or 1_000_000, args.runs)
        if args.which in ("ready", "all"):
            bench_ready(bootstrap, args.runs)


if __name__ == "__main__":
    main()
