"""The fault suite (`make faults`): what the bridge survives, on a real broker, every record accounted for.

    python -m bench.faults [--quick] [--only NAME ...]

Each fault ends in a row: records in, successes (RDQ_EXAMPLE_LOG lines, unique sources), DLQ records (unique
sources), lost (neither), duplicates (extra success lines + extra DLQ records). The table is printed and
appended to bench/RESULTS.md; the exit status is 1 when any record was lost or any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import record
from bridge.config import BridgeConfig, parse_config
from bridge.handler_api import HandlerContext
from bridge.kafka_clients import ensure_topics
from bridge.registry import REGISTRY
from bridge.store.queries import migrations
from localkafka import LocalBroker
from tests.kafka_helpers import (
    Accounting,
    BridgeProcess,
    account,
    example_log,
    kafka_config,
    produce,
    read_dlq,
    running_bridge,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
# Rows where every record of the queue hangs or leaks test the per-record handling: to a circuit breaker that is an
# outage (it would hold the records, rightly: the `outage` row shows that), so it is off for them.
NO_BREAKER: dict[str, Any] = {"breaker": {"enabled": False}}


@dataclass
class Row:
    fault: str
    records: int
    successes: int
    dlq: int
    lost: int
    duplicates: int
    note: str = ""
    duplicate_dlq: int = 0
    # What this row claims beyond "nothing lost, no duplicate in the DLQ": field → exact value, or field →
    # (lowest, highest). The gate fails the suite when one does not hold.
    expect: dict[str, int | tuple[int, int]] = field(default_factory=dict)
    schema: int = 0  # the old-store row: the schema version the store was migrated to
    refused: int = 0  # the bad-config row: configs refused clearly (exit 2, naming file and field)

    @classmethod
    def of(cls, fault: str, result: Accounting, note: str = "", **expect: int | tuple[int, int]) -> Row:
        return cls(fault, len(result.produced), len(set(result.successes)), len(set(result.dead)),
                   len(result.missing), result.duplicate_successes + result.duplicate_dead, note,
                   result.duplicate_dead, expect)

    def failures(self) -> list[str]:
        """Every claim of this row that does not hold (empty: the row passes)."""
        problems = []
        if self.lost != 0:
            problems.append(f"lost {self.lost}")
        if self.duplicate_dlq != 0 and "duplicate_dlq" not in self.expect:
            problems.append(f"{self.duplicate_dlq} duplicates in the DLQ")
        if "ERROR" in self.note or "exited" in self.note:
            problems.append(self.note)
        for name, wanted in self.expect.items():
            got = getattr(self, name)
            low, high = wanted if isinstance(wanted, tuple) else (wanted, wanted)
            if not low <= got <= high:
                problems.append(f"{name} = {got}, expected {wanted}")
        return problems


def mixed(n: int, rng: random.Random, transient: float = 0.30, permanent: float = 0.05) -> list[bytes]:
    out = []
    for _ in range(n):
        roll = rng.random()
        fail = 99 if roll < permanent else rng.randint(1, 2) if roll < permanent + transient else 0
        out.append(f'{{"fail": {fail}}}'.encode())
    return out


def feed(config: BridgeConfig, topic: str, payloads: list[bytes], per_second: int) -> threading.Thread:
    def run() -> None:
        step = max(1, per_second // 10)
        for start in range(0, len(payloads), step):
            chunk = payloads[start : start + step]
            produce(config, topic, [(f"k{start + i}".encode(), p, []) for i, p in enumerate(chunk)])
            time.sleep(0.1)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def settle(check: Callable[[], Accounting], within: float) -> Accounting:
    deadline = time.monotonic() + within
    while True:
        result = check()
        if not result.missing or time.monotonic() > deadline:
            return result
        time.sleep(2)


def names(unique: str) -> tuple[str, str]:
    return f"in-{unique}", f"dlq-{unique}"


def own_dir(tmp: Path, unique: str) -> Path:
    """Each fault has its own store and files."""
    path = tmp / unique
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---- faults ---------------------------------------------------------------------------------------------


def sigkill(bootstrap: str, tmp: Path, quick: bool) -> Row:
    kills, n = (6, 3000) if quick else (20, 20_000)
    unique = uuid.uuid4().hex[:8]
    topic, dlq = names(unique)
    tmp = own_dir(tmp, unique)
    log = tmp / f"{unique}-example.log"
    config = kafka_config(bootstrap, tmp, unique, {
        "mixed": {"handler": "flaky", "sources": [topic], "dlq_topic": dlq, "max_attempts": 4, "lease": "5s",
                  "backoff": {"kind": "fixed", "base": "100ms"}}},
        kafka={"topic_partitions": 6,
               "consumer": {"group.instance.id": f"faults-{unique}", "session.timeout.ms": 10000}},
        engine={"instance_id": f"faults-{unique}"})  # stable, as group.instance.id: see transactional_id
    ensure_topics(config)
    payloads = mixed(n, random.Random(20))
    feeder = feed(config, topic, payloads, per_second=max(200, n // (kills * 3)))
    bridge = BridgeProcess(config, tmp / f"{unique}.yaml", {"RDQ_EXAMPLE_LOG": str(log)})
    rng = random.Random(2026)
    for _ in range(kills):
        bridge.start()
        time.sleep(rng.uniform(1.5, 4.5))
        bridge.kill()
    bridge.start()
    feeder.join()
    try:
        result = settle(lambda: account(config, log, topic, dlq, n), 600)
    finally:
        bridge.terminate()
    permanent = sum(b'"fail": 99' in p for p in payloads)
    killed_out, unexplained = _killed_out(config, dlq, payloads)
    # The DLQ record and its task's "published" mark are one Kafka transaction (SPEC §10): no duplicate in the DLQ
    # however the kills fall (read_committed, as every DLQ reader should). A record that can succeed is
    # dead-lettered only when kills spent its attempts (LEASE_EXPIRED counts against max_attempts, SPEC §4.8: how a
    # poison pill reaches the DLQ); one dead-lettered without such an attempt is a failure of the row.
    note = f"{killed_out} transient records dead-lettered after kills spent their attempts" if killed_out else ""
    if unexplained:
        note = f"ERROR {unexplained} records that can succeed dead-lettered without a LEASE_EXPIRED attempt"
    return Row.of(f"SIGKILL x{kills} during the run (30% transient, 5% permanent)", result, note,
                  dlq=permanent + killed_out, successes=(n - permanent - killed_out, n - permanent))


def _killed_out(config: BridgeConfig, dlq: str, payloads: list[bytes]) -> tuple[int, int]:
    """(records that can succeed, dead-lettered after a LEASE_EXPIRED attempt; those dead-lettered without one).
    A record's Kafka key is `k<its index>` (feed), kept by its DLQ record."""
    explained = unexplained = 0
    for dead in read_dlq(config.kafka.bootstrap_servers, dlq, settle=1.0):
        index = int((dead.key or b"k-1").decode()[1:])
        if 0 <= index < len(payloads) and b'"fail": 99' in payloads[index]:
            continue
        if any(a["outcome"] == "LEASE_EXPIRED" for a in dead.value["attempts"]):
            explained += 1
        else:
            unexplained += 1
    return explained, unexplained


def group(config: BridgeConfig, tmp: Path, names_: list[str], log: Path) -> list[BridgeProcess]:
    """Bridge processes of one consumer group, each with its own store directory and instance id."""
    out = []
    for name in names_:
        tree = config.file_tree()
        (tmp / name).mkdir(exist_ok=True)
        tree["store"]["path"] = str(tmp / name / "rdq.db")
        tree.setdefault("engine", {})["instance_id"] = name
        out.append(BridgeProcess(parse_config(tree, "<faults>"), tmp / f"{name}.yaml",
                                 {"RDQ_EXAMPLE_LOG": str(log)}, name=name))
    return out


def moving(bootstrap: str, tmp: Path, quick: bool, kind: str) -> Row:
    """Tasks outlive their bridge (SPEC §10). `disk`: 2 bridges, one SIGKILLed and its store deleted mid-run.
    `scale`: 3 bridges, two stopped with SIGTERM mid-run. The survivor finishes everything."""
    n = 2000 if quick else 10_000
    unique = uuid.uuid4().hex[:8]
    topic, dlq = names(unique)
    tmp = own_dir(tmp, unique)
    log = tmp / f"{unique}-example.log"
    config = kafka_config(bootstrap, tmp, unique, {
        "mixed": {"handler": "flaky", "sources": [topic], "dlq_topic": dlq, "max_attempts": 4,
                  "backoff": {"kind": "fixed", "base": "2s"}}}, kafka={"topic_partitions": 6})
    ensure_topics(config)
    payloads = mixed(n, random.Random(13))
    bridges = [b.start() for b in group(config, tmp, ["b0", "b1", "b2"][: 2 if kind == "disk" else 3], log)]
    feeder = feed(config, topic, payloads, per_second=max(200, n // 20))
    try:
        time.sleep(8)
        if kind == "disk":
            bridges[1].kill()
            for leftover in (tmp / "b1").iterdir():
                leftover.unlink()
        else:
            for b in bridges[1:]:
                b.terminate(60)
        feeder.join()
        result = settle(lambda: account(config, log, topic, dlq, n), 300)
    finally:
        for b in bridges:
            b.kill()
    permanent = sum(b'"fail": 99' in p for p in payloads)
    fault = ("2 bridges, one SIGKILLed and its store deleted mid-run" if kind == "disk"
             else "3 bridges scaled down to 1 (SIGTERM) mid-run")
    return Row.of(fault, result, dlq=permanent, successes=n - permanent)


def broker_down(tmp: Path, quick: bool) -> Row:
    outage = 10 if quick else 30
    broker = LocalBroker(tmp / f"broker-{uuid.uuid4().hex[:6]}").start()
    try:
        unique = uuid.uuid4().hex[:8]
        topic, dlq = names(unique)
        tmp = own_dir(tmp, unique)
        log = tmp / f"{unique}-example.log"
        config = kafka_config(broker.bootstrap_servers, tmp, unique, {
            "mixed": {"handler": "flaky", "sources": [topic], "dlq_topic": dlq, "max_attempts": 3,
                      "backoff": {"kind": "fixed", "base": "500ms"}}})
        ensure_topics(config)
        rng = random.Random(30)
        first, second = mixed(2000, rng), mixed(2000, rng)
        bridge = BridgeProcess(config, tmp / f"{unique}.yaml", {"RDQ_EXAMPLE_LOG": str(log)}).start()
        produce(config, topic, [(None, p, []) for p in first])
        time.sleep(3)
        broker.stop()
        time.sleep(outage)
        broker.start()
        produce(config, topic, [(None, p, []) for p in second])
        result = settle(lambda: account(config, log, topic, dlq, 4000), 300)
        if result.missing:  # what the bridge was doing is the clue; it is gone with the row's directory after
            print(f"broker row: records still missing; the bridge's last lines:\n{bridge.tail(200)}", file=sys.stderr)
        alive = bridge.alive
        bridge.terminate()
        permanent = sum(b'"fail": 99' in p for p in first + second)
        return Row.of(f"broker down {outage} s mid-run", result, "" if alive else "bridge exited!",
                      dlq=(permanent, 4000), successes=(1, 4000 - permanent))
    finally:
        broker.stop()


def store_full(bootstrap: str, tmp: Path, quick: bool) -> Row:
    unique = uuid.uuid4().hex[:8]
    topic, dlq = names(unique)
    tmp = own_dir(tmp, unique)
    config = kafka_config(bootstrap, tmp, unique, {
        "q": {"handler": "permanent", "sources": [topic], "dlq_topic": dlq}}, kafka={"topic_partitions": 2})
    n = 500 if quick else 2000

    async def run() -> str:
        async with running_bridge(config) as bridge:
            await bridge.store.limit_size(await bridge.store.size_bytes() + 100_000)  # room for a few tasks
            produce(config, topic, [(None, os.urandom(2000), []) for _ in range(n)])
            await wait_until(lambda: not bridge.consumer.store_healthy, within=60, what="the store to fill")
            await asyncio.sleep(3)
            stored = sum((await bridge.store.counts()).get("q", {}).values())
            await bridge.store.limit_size(None)  # space returns
            await wait_until(lambda: bridge.dlq.published >= n, within=300, what="every record dead-lettered")
            return f"paused at {stored} tasks stored, resumed by itself"

    note = asyncio.run(run())
    return Row.of("store full (SQLite page limit), then space returns", account(config, tmp / "none.log", topic,
                                                                              dlq, n, expect_dead=n), note,
                  dlq=n, successes=0)


def in_process(fault: str, bootstrap: str, tmp: Path, handler: Callable[[HandlerContext], Any],
               queue: dict[str, Any], payloads: list[bytes], **expect: int | tuple[int, int]) -> Row:
    unique = uuid.uuid4().hex[:8]
    topic, dlq = names(unique)
    tmp = own_dir(tmp, unique)
    log = tmp / f"{unique}-example.log"
    os.environ["RDQ_EXAMPLE_LOG"] = str(log)
    registry = REGISTRY.extended({"fault-handler": handler})
    config = kafka_config(bootstrap, tmp, unique, {"q": {"handler": "fault-handler", "sources": [topic],
                                                         "dlq_topic": dlq, **queue}})

    async def run() -> Accounting:
        async with running_bridge(config, registry):
            produce(config, topic, [(os.urandom(8), p, [("bin", os.urandom(4))]) for p in payloads])
            return await asyncio.to_thread(settle, lambda: account(config, log, topic, dlq, len(payloads)), 180)

    try:
        return Row.of(fault, asyncio.run(run()), **expect)
    finally:
        del os.environ["RDQ_EXAMPLE_LOG"]


async def hang(ctx: HandlerContext) -> None:
    await asyncio.sleep(3600)  # never heartbeats, never returns


_NEVER = threading.Event()


def hang_sync(ctx: HandlerContext) -> None:
    _NEVER.wait()  # a thread cannot be cancelled: it stays stuck; the queue's own threads absorb it


async def leak(ctx: HandlerContext) -> None:
    while True:  # heartbeats forever: holds its lease until the queue timeout
        await asyncio.sleep(0.2)
        ctx.heartbeat()


def crash(bootstrap: str, tmp: Path) -> Row:
    unique = uuid.uuid4().hex[:8]
    topic, dlq = names(unique)
    tmp = own_dir(tmp, unique)
    config = kafka_config(bootstrap, tmp, unique, {
        "q": {"handler": "crash", "sources": [topic], "dlq_topic": dlq, "max_attempts": 2, "lease": "1s",
              "backoff": {"kind": "fixed", "base": "10ms"}}}, kafka={"topic_partitions": 1})
    ensure_topics(config)
    n = 3
    produce(config, topic, [(f"poison-{i}".encode(), b"{}", []) for i in range(n)])
    bridge = BridgeProcess(config, tmp / f"{unique}.yaml")
    deadline = time.monotonic() + 300
    result = account(config, tmp / "none.log", topic, dlq, n)
    while result.missing and time.monotonic() < deadline:
        if not bridge.alive:
            bridge.start()
        time.sleep(2)
        result = account(config, tmp / "none.log", topic, dlq, n)
    bridge.terminate()
    return Row.of("a handler that kills its process (poison pills)", result, f"{bridge.starts} starts", dlq=n,
                  successes=0)


def outage(bootstrap: str, tmp: Path, quick: bool, breaker: bool = True) -> Row:
    """The downstream (an HTTP app on a real socket) answers 503 for a while as the records arrive, max_attempts 3:
    the queue's circuit breaker holds them, and after the outage every record succeeds: none in the DLQ. With the
    breaker off (the comparison row), retries alone spend the attempts during the outage."""
    from aiohttp import web

    from handlers.examples import append_example_log
    from localkafka.broker import free_port

    n, down_for = (1000, 6.0) if quick else (2000, 10.0)
    unique = uuid.uuid4().hex[:8]
    topic, dlq = names(unique)
    tmp = own_dir(tmp, unique)
    log = tmp / f"{unique}-example.log"
    state = {"down": True, "refused": 0}

    async def pay(request: web.Request) -> web.Response:
        await request.read()
        if state["down"]:
            state["refused"] += 1
            return web.Response(status=503, text="payments API is down")
        append_example_log({"handler": "payments", "source": request.headers["rdq.source"]})
        return web.Response(status=200)

    port = free_port()
    config = kafka_config(bootstrap, tmp, unique, {"q": {
        "handler": "payments", "sources": [topic], "dlq_topic": dlq, "max_attempts": 3,
        "http": {"url": f"http://127.0.0.1:{port}/pay", "timeout": "2s"},
        "backoff": {"kind": "fixed", "base": "200ms"},
        "breaker": {"window": "5s", "open_for": "1s", "max_open_for": "4s", "ramp": "2s", "enabled": breaker}}})

    async def run() -> tuple[Accounting, list[int]]:
        app = web.Application()
        app.router.add_post("/pay", pay)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with running_bridge(config) as bridge:
                produce(config, topic, [(f"k{i}".encode(), b"{}", []) for i in range(n)])
                await asyncio.sleep(down_for)
                state["down"] = False
                result = await asyncio.to_thread(settle, lambda: account(config, log, topic, dlq, n), 180)
                spent = [t.attempt_count for t in await bridge.store.list_tasks("q", limit=n)]
                return result, spent
        finally:
            await runner.cleanup()

    os.environ["RDQ_EXAMPLE_LOG"] = str(log)
    try:
        result, spent = asyncio.run(run())
    finally:
        del os.environ["RDQ_EXAMPLE_LOG"]
    histogram = ", ".join(f"{k}: {spent.count(k)}" for k in sorted(set(spent)))
    note = f"{state['refused']} requests refused while down; tasks by attempts spent {{{histogram}}}"
    if not breaker:
        return Row.of("the same outage, circuit breaker off (retries alone, for comparison)", result, note)
    return Row.of(f"a downstream outage ({down_for:.0f} s of HTTP 503, max_attempts 3; circuit breaker)", result,
                  note, dlq=0, successes=n)


def bad_configs(tmp: Path) -> Row:
    cases = {
        "not YAML": "kafka: [unclosed",
        "unknown field": "kafka: {bootstrap_servers: x:1}\nqueues: {q: {handler: ok, colour: blue}}\n",
        "negative lease": "kafka: {bootstrap_servers: x:1}\nqueues: {q: {handler: ok, lease: -1s}}\n",
        "remote without workers": "kafka: {bootstrap_servers: x:1}\nqueues: {q: {handler: ok, remote: true}}\n",
    }
    refused = 0
    for name, text in cases.items():
        path = tmp / f"bad-{name.replace(' ', '-')}.yaml"
        path.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "bridge.cli", "run", "--config", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        refused += int(proc.returncode == 2 and str(path) in proc.stderr)
    return Row("bad config files (rdq run exits 2 naming file and field)", len(cases), 0, 0, 0, 0,
               f"{refused}/{len(cases)} refused clearly", expect={"refused": len(cases)}, refused=refused)


def old_store(bootstrap: str, tmp: Path) -> Row:
    """A store written at schema version 1 with PENDING tasks: the bridge migrates it and runs them."""
    unique = uuid.uuid4().hex[:8]
    topic, dlq = names(unique)
    tmp = own_dir(tmp, unique)
    log = tmp / f"{unique}-example.log"
    config = kafka_config(bootstrap, tmp, unique, {"q": {"handler": "ok", "sources": [topic], "dlq_topic": dlq}})
    conn = sqlite3.connect(config.store.path, isolation_level=None)
    version, _, sql = migrations()[0]
    conn.executescript(f"BEGIN; {sql}; PRAGMA user_version={version}; COMMIT;")
    n = 50
    for i in range(n):
        conn.execute("INSERT INTO tasks (id, queue, handler_ref, payload, payload_content_type, headers, status, "
                     "attempt_count, next_attempt_at, created_at, life_started_at) VALUES (?, 'q', 'ok', x'7b7d', "
                     "'application/json', ?, 'PENDING', 1, 0, 0, 0)",
                     (f"01OLD{i:021d}", f'{{"rdq.source": "kafka://old/0/{i}"}}'))
    conn.close()
    os.environ["RDQ_EXAMPLE_LOG"] = str(log)

    async def run() -> int:
        async with running_bridge(config) as bridge:
            await wait_until(lambda: len(example_log(log)) >= n, within=60, what="the old tasks to run")
            return await bridge.store.schema_version()

    try:
        version_now = asyncio.run(run())
    finally:
        del os.environ["RDQ_EXAMPLE_LOG"]
    successes = {line["source"] for line in example_log(log)}
    return Row("a store file from schema version 1 (50 PENDING tasks)", n, len(successes), 0, n - len(successes),
               len(example_log(log)) - len(successes), f"migrated to v{version_now}",
               expect={"successes": n, "schema": len(migrations())}, schema=version_now)


def nemesis(bootstrap: str, tmp: Path, seconds: float) -> Row:
    """The randomized whole-system run (bench/nemesis.py) on this suite's broker: seeds FAULTS_SEED (or 13) and the
    next, `seconds` of faults each, the second with every bridge a supervisor of 2 children (`--processes 2`);
    every invariant of its checker must hold on each."""
    from bench.nemesis import keep_for_reading, nemesis_run

    first = int(os.environ.get("FAULTS_SEED", "13"))
    seeds = [first, first + 1]
    produced = successes = dead = 0
    problems: list[str] = []
    for seed, processes in zip(seeds, (1, 2), strict=True):
        where = tmp / f"nemesis-{seed}"
        where.mkdir(parents=True, exist_ok=True)
        verdict = nemesis_run(bootstrap, where, seed, seconds, processes=processes)
        produced, successes, dead = produced + verdict.produced, successes + verdict.successes, dead + verdict.dead
        problems += [f"seed {seed}: {v}" for v in verdict.violations]
        if verdict.violations:
            keep_for_reading(where, f"faults-nemesis-{seed}", seed)
    note = (f"seeds {seeds[0]}, {seeds[1]} (2 processes a bridge) (replay: FAULTS_SEED=N make faults "
            "FAULTS_ARGS='--only nemesis')")
    if problems:
        note = f"ERROR {'; '.join(problems)} — {note}"
    return Row("nemesis: 3 bridges, every feature on, SIGKILL/STOP/TERM, lost disks, outages, redrives, imports",
               produced, successes, dead, 0, 0, note)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller runs (CI on a busy machine)")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--nemesis", action="store_true", help="also the randomized whole-system run (2 seeds)")
    parser.add_argument("--nemesis-seconds", type=float, default=40.0, help="of faults, each seed")
    args = parser.parse_args()
    rows: list[Row] = []
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="rdq-faults-") as tmp_name, LocalBroker() as broker:
        tmp, bootstrap = Path(tmp_name), broker.bootstrap_servers
        garbage = [os.urandom(rng.randint(0, 300)) for _ in range(500)]
        huge = [os.urandom(900_000) for _ in range(10)]
        faults: dict[str, Callable[[], Row]] = {
            "sigkill": lambda: sigkill(bootstrap, tmp, args.quick),
            "disk-lost": lambda: moving(bootstrap, tmp, args.quick, "disk"),
            "scale-down": lambda: moving(bootstrap, tmp, args.quick, "scale"),
            "broker": lambda: broker_down(tmp, args.quick),
            "full": lambda: store_full(bootstrap, tmp, args.quick),
            "hang": lambda: in_process("a handler that hangs forever (no heartbeat)", bootstrap, tmp, hang,
                                       {"lease": "1s", "max_attempts": 2, "backoff": {"kind": "fixed", "base": 0},
                                        **NO_BREAKER}, [b"{}"] * 30, dlq=30, successes=0),
            "hang-sync": lambda: in_process("a sync handler that blocks forever (threads cannot be cancelled)",
                                            bootstrap, tmp, hang_sync,
                                            {"lease": "1s", "max_attempts": 2, "queue_timeout": "15s",
                                             "backoff": {"kind": "fixed", "base": 0}, **NO_BREAKER}, [b"{}"] * 30,
                                            dlq=30, successes=0),
            "leak": lambda: in_process("a handler that leaks its lease (heartbeats forever)", bootstrap, tmp, leak,
                                       {"lease": "2s", "queue_timeout": "4s", **NO_BREAKER}, [b"{}"] * 30, dlq=30,
                                       successes=0),
            "crash": lambda: crash(bootstrap, tmp),
            "outage": lambda: outage(bootstrap, tmp, args.quick),
            "outage-no-breaker": lambda: outage(bootstrap, tmp, args.quick, breaker=False),
            "garbage": lambda: in_process("garbage source records (random bytes, binary keys/headers)", bootstrap,
                                          tmp, REGISTRY.get("flaky").fn, {}, garbage,  # type: ignore[union-attr]
                                          dlq=(1, 500)),
            "huge": lambda: in_process("huge records (900 KB)", bootstrap, tmp,
                                       REGISTRY.get("permanent").fn, {}, huge,  # type: ignore[union-attr]
                                       dlq=10, successes=0),
            "config": lambda: bad_configs(tmp),
            "old-store": lambda: old_store(bootstrap, tmp),
        }
        if args.nemesis or (args.only and "nemesis" in args.only):  # .ci/run: --nemesis (see bench/nemesis.py)
            faults["nemesis"] = lambda: nemesis(bootstrap, tmp, args.nemesis_seconds)
        for name, run in faults.items():
            if args.only and name not in args.only:
                continue
            began = time.monotonic()
            try:
                row = run()
            except Exception as e:  # a fault that breaks the harness is a failure to report, not to hide
                traceback.print_exc()
                row = Row(name, 0, 0, 0, -1, 0, f"ERROR {type(e).__name__}: {str(e).splitlines()[0]}")
            row.note = f"{row.note} ({time.monotonic() - began:.0f} s)".strip()
            rows.append(row)
            print(f"{row.fault}: {row}", flush=True)
    header = "| fault | records in | successes | DLQ | lost | duplicates (of them in the DLQ) | note |"
    lines = [header, "|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r.fault} | {r.records} | {r.successes} | {r.dlq} | {r.lost} | {r.duplicates} ({r.duplicate_dlq}) "
              f"| {r.note} |" for r in rows]
    record("fault suite" + (" (quick)" if args.quick else ""), lines)
    bad = [(r.fault, r.failures()) for r in rows if r.failures()]
    for fault, problems in bad:
        print(f"FAILED: {fault}: {'; '.join(problems)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
