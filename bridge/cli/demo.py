"""`make demo` / `rdq demo`: the first ten minutes, in one command.

Starts a local broker (unless KAFKA_BOOTSTRAP_SERVERS names one) and a bridge with three example queues, sends a
few records, and prints what happens as it happens: first deliveries that succeed, failures that become tasks,
retries, a task that runs out of attempts and goes to the DLQ, one that fails permanently. Then the SRE's side:
`rdq stats`, `rdq get` of the dead task, `rdq dlq tail`, `rdq set-policy` and `rdq redrive` — and the redriven
task succeeding. Every command it runs is printed, so it can be typed again against the same bridge.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import Producer

from bridge.config import BridgeConfig, load_config
from bridge.model import Status, Task

SENT = [  # (queue, payload, what to expect)
    ("ok", b"{}", "succeeds at once"),
    ("ok", b"{}", "succeeds at once"),
    ("flaky", b'{"fail": 1}', "fails once, then succeeds on its first retry"),
    ("flaky", b'{"fail": 2}', "fails twice, then succeeds"),
    ("flaky", b'{"fail": 3}', "fails 3 times: out of attempts (max_attempts 3), to the DLQ"),
    ("permanent", b"{}", "fails permanently: to the DLQ at once, no retry"),
]


class Demo:
    def __init__(self, bootstrap: str, workdir: Path, timeout: float, out: Any = sys.stdout) -> None:
        self.workdir = workdir
        self.timeout = timeout
        self.out = out
        self.began = time.monotonic()
        self.run_id = secrets.token_hex(3)
        self.config_path = workdir / "demo.yaml"
        self.example_log = workdir / "successes.jsonl"
        self.config_path.write_text(yaml.safe_dump(self._tree(bootstrap), sort_keys=False))
        self.config: BridgeConfig = load_config(self.config_path)
        self.bridge: subprocess.Popen[str] | None = None
        self.bridge_log: list[str] = []
        self.seen: dict[str, tuple[str, int, int | None]] = {}  # task id → (status, attempts, dlq offset)
        self.successes = 0

    def _topic(self, name: str) -> str:
        return f"demo-{self.run_id}.{name}"

    def _tree(self, bootstrap: str) -> dict[str, Any]:
        queue = {"max_attempts": 3, "backoff": {"kind": "fixed", "base": "500ms"}}
        return {
            "kafka": {"bootstrap_servers": bootstrap, "group_id": f"demo-{self.run_id}", "topic_partitions": 1},
            "store": {"path": str(self.workdir / "rdq.db")},
            "queues": {f"demo.{name}": {**queue, "handler": name, "sources": [self._topic(name)],
                                        "dlq_topic": self._topic(f"{name}.dlq")}
                       for name in ("ok", "flaky", "permanent")},
            "admin": {"topic": self._topic("admin"), "reply_topic": self._topic("admin.replies"),
                      "auth": {"keys": {"demo": secrets.token_hex(24)}}},
            "engine": {"sweep_interval": "200ms", "grace_period": "5s", "handler_modules": ["handlers"]},
        }

    # ---- output ----------------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.began:5.1f}s] {text}", file=self.out, flush=True)

    def command(self, args: str, output: str) -> None:
        print(f"\n$ rdq {args} --config {self.config_path}\n{output}\n", file=self.out, flush=True)

    # ---- the bridge ------------------------------------------------------------------------------------

    def start_bridge(self) -> None:
        from bridge.kafka_clients import ensure_topics

        ensure_topics(self.config)
        env = {**os.environ, "RDQ_EXAMPLE_LOG": str(self.example_log)}
        self.bridge = subprocess.Popen(
            [sys.executable, "-m", "bridge.cli", "--log-format", "json", "run", "--config", str(self.config_path)],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        threading.Thread(target=self._pump, daemon=True).start()
        self.wait_for(lambda: any(" started: store " in line for line in self.bridge_log), "the bridge to start")
        self.say(f"bridge started (config {self.config_path}; its log: {self.workdir / 'bridge.log'})")

    def _pump(self) -> None:
        assert self.bridge is not None and self.bridge.stderr is not None
        with (self.workdir / "bridge.log").open("w") as log:
            for line in self.bridge.stderr:
                self.bridge_log.append(line)
                log.write(line)
                log.flush()

    def stop_bridge(self) -> None:
        if self.bridge is not None and self.bridge.poll() is None:
            self.bridge.send_signal(signal.SIGTERM)
            try:
                self.bridge.wait(30)
            except subprocess.TimeoutExpired:
                self.bridge.kill()
            self.say("bridge stopped")

    def wait_for(self, done: Callable[[], bool], what: str) -> None:
        deadline = self.began + self.timeout
        while not done():
            if self.bridge is not None and self.bridge.poll() is not None:
                raise DemoFailed(f"the bridge ended (exit {self.bridge.returncode}) while waiting for {what}:\n"
                                 + "".join(self.bridge_log[-20:]))
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out waiting for {what}")
            self.watch()
            time.sleep(0.1)

    # ---- what happens, as it happens -------------------------------------------------------------------

    def watch(self) -> None:
        self._successes()
        if not (self.workdir / "rdq.db").exists():
            return
        from bridge.store.reader import StoreReader

        reader = StoreReader(self.workdir / "rdq.db")
        try:
            for summary in reader.list(None, None, 1000):
                task = reader.get(summary.id)
                if task is not None:
                    self._task(task)
        except Exception:
            pass
        finally:
            reader.close()

    def _successes(self) -> None:
        if not self.example_log.exists():
            return
        lines = self.example_log.read_text().splitlines()
        for line in lines[self.successes:]:
            entry = json.loads(line)
            self.say(f"{entry['handler']:<9} {entry['source']} succeeded on attempt {entry['attempt']}")
        self.successes = len(lines)

    def _task(self, task: Task) -> None:
        before = self.seen.get(task.id)
        now = (task.status.value, len(task.attempts), task.dlq_offset)
        if before == now:
            return
        self.seen[task.id] = now
        queue = task.queue.removeprefix("demo.")
        new = task.attempts[before[1] if before else 0:]
        for attempt in new:
            if attempt.error is not None:
                what = "first delivery" if attempt.attempt_no == 1 and attempt.redrive_no == 0 and before is None \
                    else f"attempt {attempt.attempt_no}" + (f" (redrive {attempt.redrive_no})" if attempt.redrive_no
                                                            else "")
                self.say(f"{queue:<9} task {task.id} {what} failed: {attempt.error.type.rsplit('.', 1)[-1]}: "
                         f"{attempt.error.message} ({attempt.outcome.value})")
        if task.status == Status.PENDING and new and new[-1].error is not None:
            self.say(f"{'':<9} task {task.id} retry due in {_due(task)}")
        if task.status == Status.DEAD and (before is None or before[0] != "DEAD"):
            self.say(f"{'':<9} task {task.id} DEAD after {task.attempt_count} attempt(s): {task.dead_reason.type}"
                     if task.dead_reason else f"task {task.id} DEAD")
        if task.dlq_offset is not None and (before is None or before[2] is None):
            self.say(f"{'':<9} task {task.id} published to the DLQ {task.dlq_topic}/{task.dlq_partition}/"
                     f"{task.dlq_offset}")

    # ---- the story -------------------------------------------------------------------------------------

    def send(self) -> None:
        producer = Producer({"bootstrap.servers": self.config.kafka.bootstrap_servers})
        for queue, payload, expect in SENT:
            producer.produce(self._topic(queue), value=payload, key=f"{queue}-{payload.decode()}".encode())
            self.say(f"sent to {self._topic(queue)}: {payload.decode():<12} ({queue}: {expect})")
        producer.flush(30)

    def dead(self, queue: str) -> list[str]:
        return [i for i, (status, _, dlq) in self.seen.items() if status == "DEAD" and dlq is not None
                and i in self._ids_of(queue)]

    def _ids_of(self, queue: str) -> set[str]:
        from bridge.store.reader import StoreReader

        reader = StoreReader(self.workdir / "rdq.db")
        try:
            return {t.id for t in reader.list(f"demo.{queue}", None, 1000)}
        finally:
            reader.close()

    def sre(self) -> None:
        from bridge.admin.client import AdminSession
        from bridge.cli.dlq_tail import tail
        from bridge.cli.render import render

        session = AdminSession(self.config, issued_by="demo")
        try:
            [dead] = self.dead("flaky")
            self.command("stats", render("stats", session.request("stats", {}, 10, 1).final))
            self.command(f"get {dead}", render("get", session.request("get", {"task_id": dead}, 10, 1).final))
            buffer = io.StringIO()
            tail(self.config, argparse.Namespace(topic=self._topic("flaky.dlq"), json=False, follow=False,
                                                 last=None), out=buffer)
            self.command(f"dlq tail --topic {self._topic('flaky.dlq')}", buffer.getvalue().rstrip("\n"))
            policy = session.request("set-policy", {"queue": "demo.flaky", "policy": {"max_attempts": 5}}, 10, 1)
            self.command("set-policy demo.flaky --set max_attempts=5", render("set-policy", policy.final))
            redrive = session.request("redrive", {"task_id": dead}, 10, 1)
            self.command(f"redrive --task {dead}", render("redrive", redrive.final))
            self.say(f"redriven: task {dead} runs again from attempt 1, now with 5 attempts to succeed")
            self.wait_for(lambda: self.seen.get(dead, ("",))[0] == "SUCCEEDED", "the redriven task to succeed")
            self.say(f"{'':<9} task {dead} SUCCEEDED after its redrive")
        finally:
            session.close()

    def run(self) -> None:
        self.start_bridge()
        self.send()
        self.wait_for(lambda: self.successes >= 4 and len(self.dead("flaky")) == 1 and len(self.dead("permanent")) == 1,
                      "the records' outcomes")
        self.say("all six records have an outcome: 4 successes, 2 dead letters. Now the SRE's side:")
        self.sre()
        print("\nTry it yourself: `make run` starts the bridge with config/bridge.yaml; README.md has the rest.",
              file=self.out)


class DemoFailed(RuntimeError):
    pass


def _due(task: Task) -> str:
    if task.next_attempt_at is None:
        return "?"
    return f"{max(0.0, (task.next_attempt_at - time.time() * 1000) / 1000):.1f}s"


@contextlib.contextmanager
def _broker(workdir: Path) -> Iterator[str]:
    configured = os.environ.get("RDQ_KAFKA__BOOTSTRAP_SERVERS") or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if configured:
        yield configured
        return
    from localkafka.broker import LocalBroker, free_port

    broker = LocalBroker(workdir / "kafka", port=free_port(), controller_port=free_port())
    print("starting a local kafka broker (the first time, its jars come from Maven Central)…", flush=True)
    broker.start()
    print(f"kafka {broker.bootstrap_servers} started in {broker.startup_seconds:.1f}s", flush=True)
    try:
        yield broker.bootstrap_servers
    finally:
        broker.stop()


def main(timeout: float = 180.0) -> int:
    with tempfile.TemporaryDirectory(prefix="rdq-demo-") as tmp, _broker(Path(tmp)) as bootstrap:
        demo = Demo(bootstrap, Path(tmp), timeout)
        try:
            demo.run()
            return 0
        except DemoFailed as e:
            print(f"demo: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        finally:
            demo.stop_bridge()
