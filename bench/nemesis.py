"""A randomized whole-system run on the real broker (Jepsen's idea): every feature on at once, a seeded nemesis,
and an outside checker of the invariants.

    python -m bench.nemesis [--seed N] [--seconds S]        (FAULTS_SEED=N replays a seed; `make soak`: long)

Three bridge processes of one group, each with its own store, the changelog on (`--static N`: N of them static
members, as the Kubernetes example deploys them; `--processes N`: each bridge a supervisor of N children, each
child a member with a store of its own), and three queues:
- `mixed` (ordering: key, binary keys some of whose base64 holds `/`, the breaker on): ok, transient, permanent,
  hang and fixable records (bench/nemesis_handlers.py);
- `poison`: records whose handler SIGKILLs the bridge running it, every time;
- `pay`: an HTTP handler in front of a downstream the nemesis takes down and brings back (the breaker on).
While records flow, the nemesis (seeded) SIGKILLs, SIGSTOPs (past the session timeout: a zombie) and SIGCONTs,
SIGTERMs, deletes a bridge's store and restarts it, and takes the downstream down. Under `--processes`, a SIGKILL
or SIGSTOP hits the supervisor or one of its children (its supervisor restarts a child that died); a supervisor
SIGKILLed is started again while its children may still be stopping, as an orphan's would. Mid-run the fix is deployed
(fixable records succeed from then on); a foreign DLQ (Kafka Connect format, records older than `mixed`'s task_ttl)
is imported into `mixed`; after the healing both are redriven through the admin topic.

The checker, from outside (the example log, the downstream's own log, the DLQ topics read_committed, the stores):
1. nothing lost: every record ended as a success or a DLQ record;
2. no DLQ duplicate: at most one DLQ record per record and redrive;
3. one end: no record that cannot fail both succeeded and dead-lettered (a success is final);
4. poison pills: every one in the DLQ, with no more counted attempts than max_attempts;
5. per-key order: each key's first successes in offset order;
6. fixed and imported records: every one succeeded after its redrive;
7. the breaker: `pay` drained within its bound once the downstream was back;
8. nothing left open: no PENDING, IN_FLIGHT or PARKED task in any store.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from bench.common import record
from bridge.config import BridgeConfig, parse_config
from bridge.kafka_clients import ensure_topics
from localkafka import LocalBroker
from localkafka.broker import free_port
from tests.kafka_helpers import BridgeProcess, example_log, read_dlq, sources_of

ROOT = Path(__file__).resolve().parent.parent
MIXED_ATTEMPTS, POISON_ATTEMPTS = 6, 3
# `--static N`: the first N bridges are static members (`group.instance.id`, as the Kubernetes example deploys each
# pod): restarted within the session timeout, a bridge takes its own partitions back without a rebalance. The
# others are dynamic: every restart is a rebalance (a leave noticed after the session timeout, then a join).
# Default 0: with static members the run does not pass yet (README: "The randomized whole-system run").
PAY_BREAKER = {"window": "5s", "min_attempts": 10, "open_for": "1s", "max_open_for": "4s", "reset_after": "20s",
               "ramp": "2s"}


class Downstream:
    """The app behind the `pay` queue's HTTP handler: 503 while down; logs each success's rdq.source."""

    def __init__(self) -> None:
        self.down = False
        self.successes: list[tuple[str, float]] = []
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if owner.down:
                    self.send_response(503)
                else:
                    with owner.lock:
                        owner.successes.append((self.headers.get("rdq.source", ""), time.time()))
                    self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@dataclass
class Run:
    seed: int
    seconds: float
    tmp: Path
    bootstrap: str
    unique: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    actions: Counter[str] = field(default_factory=Counter)
    kinds: dict[str, str] = field(default_factory=dict)  # source → kind (the records of `mixed`)
    keys: dict[str, bytes] = field(default_factory=dict)  # source → its key (mixed)
    healed_at: float = 0.0
    imported: bool = False  # every record of the foreign DLQ is a task of `mixed`
    last_restart: float = 0.0  # the last restart of a bridge a poison pill killed
    processes: int = 1  # children of each bridge's supervisor (1: no supervisor)

    @property
    def retain(self) -> float:
        """`mixed`'s task_ttl, s: longer than the run (a dead record is still in its store at the final redrive);
        the foreign DLQ's records died an hour before that (an old team's DLQ: imported, they are kept from then)."""
        return max(3600.0, 2 * self.seconds)

    def topic(self, queue: str) -> str:
        return f"{queue}-{self.unique}"

    def dlq(self, queue: str) -> str:
        return f"{queue}-{self.unique}.dlq"


def config_of(run: Run, port: int) -> BridgeConfig:
    chaos = {"handler": "chaos", "backoff": {"kind": "fixed", "base": "300ms"}}
    return parse_config({
        "kafka": {"bootstrap_servers": run.bootstrap, "group_id": f"nemesis-{run.unique}", "topic_partitions": 3,
                  "consumer": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000}},
        "store": {"path": str(run.tmp / "unused.db")},
        "engine": {"handler_modules": ["handlers", "bench.nemesis_handlers"], "sweep_interval": "200ms",
                   "grace_period": "5s"},
        "admin": {"topic": f"admin-{run.unique}", "reply_topic": f"replies-{run.unique}", "auth": "none"},
        "queues": {
            "mixed": {**chaos, "sources": [run.topic("mixed")], "dlq_topic": run.dlq("mixed"), "ordering": "key",
                      "max_attempts": MIXED_ATTEMPTS, "lease": "2s", "max_redrives": 3,
                      "task_ttl": f"{run.retain:.0f}s",
                      "errors": {"permanent": ["bench.nemesis_handlers.NotDeployed"]}},
            "poison": {**chaos, "sources": [run.topic("poison")], "dlq_topic": run.dlq("poison"),
                       "max_attempts": POISON_ATTEMPTS, "lease": "2s", "breaker": {"enabled": False}},
            "pay": {"handler": "pay", "sources": [run.topic("pay")], "dlq_topic": run.dlq("pay"),
                    "http": {"url": f"http://127.0.0.1:{port}/pay", "timeout": "2s"}, "max_attempts": 4,
                    "backoff": {"kind": "fixed", "base": "200ms"}, "breaker": PAY_BREAKER},
        },
    }, "<nemesis>")


def bridges(run: Run, config: BridgeConfig, log: Path, fixed: Path, static: int = 0) -> list[BridgeProcess]:
    out = []
    for i in range(3):
        name = f"n{i}"
        tree = config.file_tree()
        (run.tmp / name).mkdir(exist_ok=True)
        tree["store"]["path"] = str(run.tmp / name / "rdq.db")
        tree["engine"]["instance_id"] = name
        if run.processes > 1:
            tree["engine"]["processes"] = run.processes
        if i < static:  # a stable identity, as deploy/kubernetes gives each pod: a restart takes its partitions back
            tree["kafka"]["consumer"]["group.instance.id"] = f"nemesis-{run.unique}-{name}"
        out.append(BridgeProcess(parse_config(tree, "<nemesis>"), run.tmp / f"{name}.yaml",
                                 {"RDQ_EXAMPLE_LOG": str(log), "NEMESIS_FIXED": str(fixed)}, name=name))
    return out


# ---- the records --------------------------------------------------------------------------------------------


def binary_keys(rng: random.Random, n: int) -> list[bytes]:
    """Keys of random bytes, half of them chosen so that their base64 holds a `/` (and one empty key)."""
    keys: list[bytes] = [b""]
    while len(keys) < n:
        key = rng.randbytes(rng.randint(1, 12))
        if (b"/" in base64.b64encode(key)) == (len(keys) % 2 == 0):
            keys.append(key)
    return keys


def mixed_payload(rng: random.Random) -> dict[str, Any]:
    roll = rng.random()
    if roll < 0.55:
        return {"kind": "ok"}
    if roll < 0.80:
        return {"kind": "transient", "fail": rng.randint(1, 2)}
    if roll < 0.87:
        return {"kind": "permanent"}
    if roll < 0.93:
        return {"kind": "fixable"}
    return {"kind": "hang", "ms": 3000}


def feed(run: Run, rng: random.Random, stop: threading.Event) -> threading.Thread:
    """Records to all three queues for `run.seconds`, a few batches a second."""
    keys = binary_keys(rng, 40)
    producer = Producer({"bootstrap.servers": run.bootstrap, "linger.ms": 5})
    plan: list[tuple[str, bytes | None, dict[str, Any]]] = []
    batches = int(run.seconds * 4)
    for _ in range(batches):
        for _ in range(rng.randint(5, 15)):
            plan.append(("mixed", rng.choice(keys), mixed_payload(rng)))
        for _ in range(rng.randint(2, 6)):
            plan.append(("pay", None, {"kind": "ok"}))
        if rng.random() < 0.03:  # each pill kills a bridge max_attempts times: the group rebalances each time
            plan.append(("poison", None, {"kind": "crash"}))

    def sent(queue: str, key: bytes | None, payload: dict[str, Any]) -> Any:
        def report(err: Any, msg: Any) -> None:
            if err is None and queue == "mixed":
                source = f"kafka://{msg.topic()}/{msg.partition()}/{msg.offset()}"
                run.kinds[source] = payload["kind"]
                run.keys[source] = key or b""
        return report

    def go() -> None:
        per_batch = max(1, len(plan) // batches)
        for start in range(0, len(plan), per_batch):
            if stop.is_set():
                break
            for queue, key, payload in plan[start : start + per_batch]:
                producer.produce(run.topic(queue), key=key, value=json.dumps(payload).encode(),
                                 on_delivery=sent(queue, key, payload))
            producer.poll(0)
            time.sleep(0.25)
        producer.flush(60)

    thread = threading.Thread(target=go, name="nemesis-feed")
    thread.start()
    return thread


def legacy_dlq(run: Run, n: int) -> None:
    """A foreign DLQ (Kafka Connect format) of `n` ok records, to import into `mixed` while it runs; they died
    longer ago than `mixed` keeps a finished task (counted from their death, the sweep purged them once imported)."""
    died = int((time.time() - run.retain - 3600) * 1000)
    producer = Producer({"bootstrap.servers": run.bootstrap})
    for i in range(n):
        headers = [("__connect.errors.topic", f"legacy-{run.unique}".encode()), ("__connect.errors.partition", b"0"),
                   ("__connect.errors.offset", str(i).encode()),
                   ("__connect.errors.exception.class.name", b"org.apache.kafka.connect.errors.DataException"),
                   ("__connect.errors.exception.message", b"the sink refused it")]
        producer.produce(f"legacy-{run.unique}.dlq", key=f"legacy-{i}".encode(), value=b'{"kind": "ok"}',
                         headers=headers, timestamp=died)
    producer.flush(30)


# ---- the nemesis --------------------------------------------------------------------------------------------


class Supervisor:
    """Starts a bridge that died (a poison pill's SIGKILL) again, as its supervisor would (systemd, Kubernetes):
    from its own thread, every half second, so an admin command the checker waits on never leaves the group
    without its bridges. Bridges the nemesis is acting on (`acting`) are left to it."""

    def __init__(self, run: Run, group: list[BridgeProcess]) -> None:
        self.run, self.group = run, group
        self.lock = threading.Lock()
        self.busy: set[int] = set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="nemesis-supervisor", daemon=True)

    def start(self) -> None:
        for bridge in self.group:
            bridge.start()
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(30)

    @contextlib.contextmanager
    def acting(self, i: int) -> Any:
        with self.lock:
            self.busy.add(i)
        try:
            yield
        finally:
            with self.lock:
                self.busy.discard(i)

    def _watch(self) -> None:
        kids: dict[int, tuple[int, set[int]]] = {}  # bridge → (its supervisor's pid, that supervisor's children)
        while not self.done.wait(0.5):
            for i, bridge in enumerate(self.group):
                if self.run.processes > 1 and bridge.alive:  # a child its supervisor started again: a rebalance
                    now = set(children_of(bridge.proc.pid))
                    before = kids.get(i, (bridge.proc.pid, now))
                    if before[0] == bridge.proc.pid and before[1] and now - before[1]:
                        self.run.actions["child restarted by its supervisor"] += len(now - before[1])
                        self.run.last_restart = time.time()
                    kids[i] = bridge.proc.pid, now
                with self.lock:
                    if i in self.busy or bridge.alive or self.done.is_set():
                        continue
                    self.busy.add(i)
                try:
                    self.run.actions["restart after a crash"] += 1
                    self.run.last_restart = time.time()
                    bridge.start()
                finally:
                    with self.lock:
                        self.busy.discard(i)


class Nemesis:
    def __init__(self, run: Run, rng: random.Random, supervisor: Supervisor, downstream: Downstream) -> None:
        self.run, self.rng, self.supervisor, self.downstream = run, rng, supervisor, downstream
        self.group = supervisor.group
        self.stopped: set[int] = set()  # SIGSTOPped bridges

    def act(self) -> None:
        action = self.rng.choice(["kill", "kill", "stop", "term", "disk", "outage"])
        i = self.rng.randrange(len(self.group))
        self.run.actions[action] += 1
        log(f"nemesis: {action} n{i}")
        with self.supervisor.acting(i):
            self._do(action, i)

    def _do(self, action: str, i: int) -> None:
        bridge = self.group[i]
        kids = children_of(bridge.proc.pid) if bridge.alive and self.run.processes > 1 else []
        if action in ("kill", "stop") and kids and self.rng.random() < 0.5:
            self._to_a_child(action, self.rng.choice(sorted(kids)))
            return
        if action == "outage":
            self.downstream.down = True
            time.sleep(self.rng.uniform(3, 8))
            self.downstream.down = False
        elif action == "stop" and bridge.alive and i not in self.stopped:
            os.kill(bridge.proc.pid, signal.SIGSTOP)
            self.stopped.add(i)
            time.sleep(self.rng.uniform(2, 9))  # past the 6 s session timeout: a zombie
            os.kill(bridge.proc.pid, signal.SIGCONT)
            self.stopped.discard(i)
        elif action == "term":
            if bridge.alive:
                bridge.terminate(30)
            bridge.start()
        elif action in ("kill", "disk"):
            bridge.kill()  # a supervisor's children see their lifeline close and stop by themselves meanwhile
            if action == "disk":
                for leftover in (self.run.tmp / bridge.name).iterdir():
                    leftover.unlink()
            time.sleep(self.rng.uniform(0.5, 3))
            bridge.start()

    def _to_a_child(self, action: str, pid: int) -> None:
        """`--processes`: SIGKILL a child (its supervisor starts it again), or SIGSTOP it past the session timeout
        (a zombie child, its partitions moved to the others) and SIGCONT it."""
        self.run.actions[f"{action} a child"] += 1
        with contextlib.suppress(ProcessLookupError):
            if action == "kill":
                os.kill(pid, signal.SIGKILL)
                return
            os.kill(pid, signal.SIGSTOP)
            time.sleep(self.rng.uniform(2, 9))
            os.kill(pid, signal.SIGCONT)


def children_of(pid: int) -> list[int]:
    """A supervisor's children (bridge processes), by their parent in /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def resume(bridge: BridgeProcess) -> list[int]:
    """SIGCONT a running bridge and, under `--processes`, its children (any of them may be stopped); its children."""
    if not bridge.alive:
        return []
    kids = children_of(bridge.proc.pid)
    for pid in [bridge.proc.pid, *kids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return kids


def stores(run: Run, i: int) -> list[Path]:
    """Bridge i's store files: one, or a child's each (`rdq-0.db`, …) under `--processes`."""
    return sorted(p for p in (run.tmp / f"n{i}").glob("rdq*.db") if store_rows(p, "SELECT 1"))


def open_tasks(run: Run) -> int:
    return sum(int(store_rows(db, "SELECT COUNT(*) FROM tasks WHERE status IN ('PENDING', 'IN_FLIGHT', 'PARKED')")
                   [0][0] or 0) for i in range(3) for db in stores(run, i))


def rdq(config_path: Path, *args: str, timeout: float = 120) -> int:
    """An `rdq` admin command, as an SRE would type it; its exit code (0: every instance answered, all done)."""
    done = subprocess.run([sys.executable, "-m", "bridge.cli", *args, "--config", str(config_path), "--json",
                           "--timeout", "30"], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    log(f"rdq {' '.join(args)}: exit {done.returncode} {done.stderr.strip()[-300:]}")
    return done.returncode


def log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


# ---- the checker --------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    produced: int = 0
    successes: int = 0
    dead: int = 0
    violations: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.violations.append(what)


def store_rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    if not db.exists():
        return []
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()


def check(run: Run, config: BridgeConfig, log_path: Path, downstream: Downstream, imported: int,
          pay_drained_at: float | None) -> Verdict:
    verdict = Verdict()
    lines = example_log(log_path)
    ok_lines = defaultdict(list)
    for line in lines:
        ok_lines[line["source"]].append(line)
    dead: dict[str, list[Any]] = {}
    for queue in ("mixed", "poison", "pay"):
        produced = sources_of(config, run.topic(queue), _count(config, run.topic(queue)))
        records = read_dlq(run.bootstrap, run.dlq(queue), settle=3.0)
        per_record = Counter((r.source, r.value["task"]["redrive_count"]) for r in records)
        duplicates = sum(n - 1 for n in per_record.values())
        verdict.check(duplicates == 0, f"{queue}: {duplicates} duplicate DLQ records")
        dead_sources = {r.source for r in records}
        for r in records:
            dead.setdefault(r.source, []).append(r)
        succeeded = ({s for s, _ in downstream.successes} if queue == "pay" else set(ok_lines)) & produced
        lost = produced - succeeded - dead_sources
        verdict.check(not lost, f"{queue}: {len(lost)} records lost, e.g. {sorted(lost)[:3]}")
        verdict.produced += len(produced)
        verdict.successes += len(succeeded)
        verdict.dead += len(dead_sources & produced)
        if queue == "poison":
            verdict.check(dead_sources >= produced, f"poison: {len(produced - dead_sources)} pills not in the DLQ")
            over = [r.source for r in records if r.value["task"]["attempt_count"] > POISON_ATTEMPTS]
            verdict.check(not over, f"poison: {len(over)} pills counted past max_attempts")
        if queue == "pay":
            # At-least-once: the app may have done a record's work while the bridge never learned it (killed, or
            # stopped past its lease, while the call ran: a LEASE_EXPIRED attempt); its retries may then fail in
            # an outage and dead-letter it. Allowed only with such an attempt in its DLQ record's history; a
            # record whose success reached the bridge must never be dead-lettered.
            both = succeeded & dead_sources
            unanswered = {s for s in both if any(a["outcome"] == "LEASE_EXPIRED" for r in dead[s]
                                                 for a in r.value["attempts"])}
            verdict.figures["pay dead-lettered"] = len(dead_sources & produced)
            verdict.figures["pay done by the app, then dead-lettered after an unanswered attempt"] = len(unanswered)
            verdict.check(not both - unanswered, f"pay: {len(both - unanswered)} records both succeeded and "
                                                 "dead-lettered without an attempt the bridge never heard back from")
    # 3. One end: a record that cannot fail (ok, transient, hang) did not dead-letter after it succeeded.
    for source, kind in run.kinds.items():
        if kind in ("ok", "transient", "hang") and source in ok_lines and source in dead:
            verdict.violations.append(f"mixed: {source} ({kind}) both succeeded and dead-lettered")
    # 5. Per-key order: each key's records' first successes in offset order.
    by_key: dict[bytes, list[tuple[int, int, float]]] = defaultdict(list)
    for source, key in run.keys.items():
        if source in ok_lines and run.kinds[source] != "fixable":  # fixed ones run again after a redrive
            first = min(line["t"] for line in ok_lines[source])
            _, partition, offset = source.rsplit("/", 2)
            by_key[key].append((int(partition), int(offset), first))
    out_of_order = 0
    for entries in by_key.values():
        for partition in {p for p, _, _ in entries}:
            times = [t for p, _, t in sorted(e for e in entries if e[0] == partition)]
            out_of_order += sum(1 for a, b in itertools.pairwise(times) if b < a)
    verdict.check(out_of_order == 0, f"mixed: {out_of_order} records of a key succeeded before an earlier one")
    # 6. Fixed and imported records succeeded after their redrive.
    fixable = [s for s, k in run.kinds.items() if k == "fixable"]
    unfixed = [s for s in fixable if s not in ok_lines]
    verdict.check(not unfixed, f"mixed: {len(unfixed)} fixable records never succeeded")
    legacy = {s for s in ok_lines if s.startswith(f"kafka://legacy-{run.unique}/")}
    verdict.check(len(legacy) == imported, f"imported: {len(legacy)} of {imported} succeeded after the redrive")
    # 7. The breaker released `pay` within its bound after the downstream came back.
    # Once the downstream is back and the group stable (the last poison pill's crash: every crash is a rebalance
    # and a restore of the partitions that move), `pay` drains within its breaker's bound (max_open_for 4 s, the
    # ramp 2 s), a restore and the retries' backoff.
    bound = 60
    stable = max(run.healed_at, run.last_restart)
    drained = None if pay_drained_at is None else round(max(0.0, pay_drained_at - stable), 1)
    verdict.figures["pay drained after healing (s)"] = None if pay_drained_at is None else round(
        pay_drained_at - run.healed_at, 1)
    verdict.figures["pay drained after the group was stable (s)"] = drained
    verdict.check(drained is not None and drained <= bound,
                  f"pay: drained {drained} s after the downstream was back and the group stable (bound {bound})")
    # 8. Nothing left open.
    left = open_tasks(run)
    verdict.check(left == 0, f"{left} tasks left open")
    verdict.figures["stores read"] = sum(len(stores(run, i)) for i in range(3))
    verdict.check(verdict.figures["stores read"] >= 3 * run.processes, "a bridge's store was not found to read")
    verdict.figures["success lines (with at-least-once repeats)"] = len(lines)
    verdict.figures["faults"] = dict(run.actions)
    return verdict


def _count(config: BridgeConfig, topic: str, within: float = 180.0) -> int:
    """Records in a topic. The checker's own client may not know the topic's partitions yet right after a burst of
    rebalances (`Unknown partition` from a fresh client), or the broker may still be coming back from the run's
    faults (CI saw a minute of transport failures after the heal): it asks again, with a new client, for up to
    `within` seconds (a time budget, not a count of tries: some failures are instant, others take 10 s)."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    deadline = time.monotonic() + within
    while True:
        consumer = Consumer({"bootstrap.servers": config.kafka.bootstrap_servers, "group.id": "nemesis-count"})
        try:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            return sum(h - lo for p in partitions
                       for lo, h in [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)])
        except KafkaException as e:
            if time.monotonic() > deadline:
                raise
            log(f"checker: {e} (asking again)")
            time.sleep(1.0)
        finally:
            consumer.close()


# ---- the run ------------------------------------------------------------------------------------------------


def nemesis_run(bootstrap: str, tmp: Path, seed: int, seconds: float, static: int = 0, processes: int = 1) -> Verdict:
    run = Run(seed, seconds, tmp, bootstrap, processes=processes)
    rng = random.Random(seed)
    log(f"nemesis: seed {seed} (replay: FAULTS_SEED={seed}), {seconds:g} s of faults")
    downstream = Downstream()
    config = config_of(run, downstream.port)
    ensure_topics(config)
    _topic(run, f"legacy-{run.unique}.dlq")
    example = tmp / "success.log"
    fixed = tmp / "fixed"
    group = bridges(run, config, example, fixed, static)
    supervisor = Supervisor(run, group)
    nemesis = Nemesis(run, rng, supervisor, downstream)
    imported = 40
    legacy_dlq(run, imported)
    stop = threading.Event()
    try:
        supervisor.start()
        feeder = feed(run, rng, stop)
        began = time.monotonic()
        deployed = imported_now = False
        while time.monotonic() - began < seconds:
            time.sleep(rng.uniform(1.5, 4.0))
            nemesis.act()
            if not deployed and time.monotonic() - began > seconds * 0.4:
                fixed.write_text("deployed")  # fixable records succeed from now on
                deployed = True
            if not imported_now and time.monotonic() - began > seconds * 0.5:
                # While bridges come and go, some records may be taken by no instance (exit 7): settle() imports
                # again until all are in (the same record imported twice makes one task).
                imported_now = True
                run.imported = rdq(group[0].path, "import", "--topic", f"legacy-{run.unique}.dlq", "--queue",
                                   "mixed") == 0
        feeder.join()
        # Heal: everyone up (the supervisor restarts the dead), the downstream up; then the redrives of what died
        # before the fix, and the imports.
        downstream.down = False
        for bridge in group:
            resume(bridge)
        run.healed_at = time.time()
        log("nemesis: healed")
        # A long run leaves a long backlog: the settling time grows with it (never less than 5 minutes).
        pay_drained_at = settle(run, config, example, downstream, group, within=max(300.0, seconds))
        return check(run, config, example, downstream, imported, pay_drained_at)
    finally:
        stop.set()
        supervisor.stop()
        for bridge in group:
            with contextlib.suppress(Exception):
                kids = resume(bridge)
                bridge.kill()
                for pid in kids:  # not left stopping on their own after the run
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        downstream.close()
        log(f"nemesis: actions {dict(run.actions)}")


def settle(run: Run, config: BridgeConfig, example: Path, downstream: Downstream, group: list[BridgeProcess],
           within: float = 300) -> float | None:
    """Redrive the fixed and imported records (the supervisor keeps crashed bridges running), and wait until every
    record is accounted for (or the time is up). Returns when `pay` drained (wall time)."""
    deadline = time.monotonic() + within
    pay_total = _count(config, run.topic("pay"))
    drained: list[float] = []
    done = threading.Event()

    def watch_pay() -> None:  # on its own: an admin command below may take a minute, the drain is timed apart
        while not done.is_set() and not drained:
            if _pay_drained(run, downstream, pay_total):
                drained.append(time.time())
            done.wait(1.0)

    watcher = threading.Thread(target=watch_pay, name="nemesis-pay-watch", daemon=True)
    watcher.start()
    try:
        return _settle_loop(run, config, example, group, deadline, drained)
    finally:
        done.set()
        watcher.join(30)


def _settle_loop(run: Run, config: BridgeConfig, example: Path, group: list[BridgeProcess], deadline: float,
                 drained: list[float]) -> float | None:
    next_redrive = 0.0
    rounds = 0
    while time.monotonic() < deadline:
        if time.monotonic() >= next_redrive:
            if not run.imported:
                run.imported = rdq(group[0].path, "import", "--topic", f"legacy-{run.unique}.dlq", "--queue",
                                   "mixed") == 0
            # What died before the fix was deployed, and the imported records (DataException).
            for error in ("NotDeployed", "DataException"):
                rdq(group[0].path, "redrive", "--queue", "mixed", "--error-type", error, "--rate", "500")
            next_redrive = time.monotonic() + 15
        if drained and _accounted_now(run, config, example, say=rounds >= _SAY_AFTER):
            return drained[0]
        rounds += 1
        time.sleep(3)
    return drained[0] if drained else None


def _pay_drained(run: Run, downstream: Downstream, pay_total: int) -> bool:
    from confluent_kafka import KafkaException

    try:
        return len({s for s, _ in downstream.successes}) + _dead(run, "pay") >= pay_total
    except KafkaException as e:
        log(f"checker: {e} (asking again)")
        return False


# A settle still waiting after this many rounds (~3 s each, plus the checks) says what it waits for, each round.
_SAY_AFTER = 10


def _accounted_now(run: Run, config: BridgeConfig, example: Path, say: bool = False) -> bool:
    """`_unaccounted` is empty, or not yet when the checker's own client failed (a busy 2-core machine: a metadata
    request of the checker timed out once); the bridges are judged by what they wrote, not by the checker's luck.
    `say`: log what is still not accounted for (a settle that takes long can be read afterwards)."""
    from confluent_kafka import KafkaException

    try:
        missing = _unaccounted(run, config, example)
    except KafkaException as e:
        log(f"checker: {e} (asking again)")
        return False
    if missing and say:
        log(f"settle: still waiting for {'; '.join(missing)}")
    return not missing


def _dead(run: Run, queue: str) -> int:
    return len({r.source for r in read_dlq(run.bootstrap, run.dlq(queue), settle=0.5, timeout=10)})


def _unaccounted(run: Run, config: BridgeConfig, example: Path) -> list[str]:
    """What is not accounted for yet (empty: every record is): mixed records handled, or dead-lettered unless
    fixable; the 40 imported legacy records handled; every poison record in its DLQ; no task left open."""
    lines = {line["source"] for line in example_log(example)}
    missing = []
    mixed = [s for s in run.kinds if s not in lines]
    if mixed:
        mixed_dead = {r.source for r in read_dlq(run.bootstrap, run.dlq("mixed"), settle=0.5, timeout=10)}
        mixed = [s for s in mixed if s not in mixed_dead or run.kinds[s] == "fixable"]
    if mixed:
        missing.append(f"mixed: {len(mixed)} records neither handled nor dead-lettered as they should be "
                       f"(first {mixed[0]}, {run.kinds[mixed[0]]})")
    legacy = [s for s in lines if s.startswith(f"kafka://legacy-{run.unique}/")]
    if len(legacy) != 40:
        missing.append(f"legacy: {len(legacy)} of 40 imported records handled")
    poison, dead = _count(config, run.topic("poison")), _dead(run, "poison")
    if dead < poison:
        missing.append(f"poison: {dead} of {poison} records in its DLQ")
    if (left := open_tasks(run)) != 0:
        missing.append(f"{left} tasks open in the stores")
    return missing


def _topic(run: Run, name: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": run.bootstrap})
    for future in admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)]).values():
        future.result(30)


def keep_for_reading(run_dir: Path, name: str, seed: int) -> None:
    """A seed that broke an invariant: its bridges' logs and stores copied to .rdq/NAME, to read afterwards (its
    run's temporary folder goes)."""
    kept = Path(".rdq") / name
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(run_dir, kept)
    print(f"seed {seed}: its logs and stores are kept in {kept}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("FAULTS_SEED", "0")) or None)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=1, help="seeds seed, seed+1, …")
    parser.add_argument("--static", type=int, default=0, help="how many of the 3 bridges are static members")
    parser.add_argument("--processes", type=int, default=1, help="each bridge a supervisor of this many children")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    failed = 0
    lines = []
    with tempfile.TemporaryDirectory(prefix="rdq-nemesis-") as tmp_name, LocalBroker() as broker:
        for n in range(args.runs):
            tmp = Path(tmp_name) / str(seed + n)
            tmp.mkdir()
            began = time.monotonic()
            verdict = nemesis_run(broker.bootstrap_servers, tmp, seed + n, args.seconds, args.static,
                                  args.processes)
            print(f"seed {seed + n}: {verdict}", flush=True)
            failed += bool(verdict.violations)
            if verdict.violations:
                keep_for_reading(tmp, f"nemesis-{seed + n}", seed + n)
            lines.append(f"seed {seed + n}, {args.seconds:g} s of faults, {args.static} static members, "
                         f"{args.processes} process{'es' if args.processes > 1 else ''} a bridge "
                         f"({time.monotonic() - began:.0f} s in all): "
                         f"{verdict.produced} records, {verdict.successes} succeeded, {verdict.dead} in a DLQ; "
                         f"{verdict.figures}; violations: {verdict.violations or 'none'}")
    record("nemesis (randomized whole-system run)", lines)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
