"""`engine.processes` / `rdq run --processes N`: a supervisor of N bridge processes (bridge/supervisor).

Against a real broker: two children share the partitions and a child killed with SIGKILL loses nothing (its
partitions move to its sibling and come back when it is restarted); one `/metrics` and `/readyz` for all; each
child answers the admin topic as its own instance; a child that crash-loops backs off, is reported unready and
takes nothing else down; a supervisor killed with SIGKILL leaves no child behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bridge.config import BridgeConfig, ConfigError, parse_config
from bridge.config.cores import cores
from bridge.config.processes import ChildSpec, as_child, base_identity, child_config, process_count
from bridge.kafka_clients import ensure_topics, transactional_id
from localkafka.broker import free_port
from tests.conftest import KafkaEnv
from tests.kafka_helpers import BridgeProcess, account, kafka_config
from tests.test_kafka_faults import mixed_payloads, produce_slowly, wait_accounted

ROOT = Path(__file__).resolve().parent.parent


# ---- each child's own config (no broker) -----------------------------------------------------------------------


def _tree(**extra: Any) -> dict[str, Any]:
    tree: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "k:9092", "consumer": {"group.instance.id": "pod-7"}},
        "store": {"path": "/data/rdq.db", "max_size_mb": 1000},
        "queues": {"q": {"handler": "ok", "sources": ["in"]}},
        "telemetry": {"host": "0.0.0.0", "port": 9400},
        "workers": {"listen": ["tcp://0.0.0.0:7070", "unix:///run/rdq/w.sock", "tcp://127.0.0.1:0"],
                    "tokens": ["t" * 32]},
    }
    tree.update(extra)
    return tree


def test_each_child_has_its_own_store_identity_ports_and_static_member_id() -> None:
    config = parse_config(_tree(engine={"instance_id": "pod-7", "processes": 3}))
    one = child_config(config, 1, 3)
    assert str(one.store.path) == "/data/rdq-1.db" and one.store.max_size_mb == pytest.approx(1000 / 3)
    assert one.engine.instance_id == "pod-7-1" and one.engine.processes == 1
    assert transactional_id(one) == "rdq-rdq-bridge-pod-7-1" != transactional_id(child_config(config, 2, 3))
    assert (one.telemetry.host, one.telemetry.port) == ("127.0.0.1", 0)  # the supervisor serves 9400
    assert one.kafka.consumer["group.instance.id"] == "pod-7-1"
    assert one.workers is not None
    assert one.workers.listen == ["tcp://0.0.0.0:7071", "unix:///run/rdq/w-1.sock", "tcp://127.0.0.1:0"]
    # Secrets stay secrets; the rest is the file's.
    assert one.workers.tokens[0].get_secret_value() == "t" * 32 and one.queues == config.queues


def test_without_an_instance_id_the_children_of_two_stores_on_one_host_never_share_an_id() -> None:
    a = parse_config(_tree(store={"path": "/a/rdq.db"}))
    b = parse_config(_tree(store={"path": "/b/rdq.db"}))
    assert base_identity(a) != base_identity(b)
    assert child_config(a, 0, 2).engine.instance_id == f"{base_identity(a)}-0"
    assert base_identity(a) == base_identity(parse_config(_tree(store={"path": "/a/rdq.db"})))  # stable


def test_the_child_environment_is_read_and_bad_values_refused() -> None:
    config = parse_config(_tree(engine={"instance_id": "p"}))
    env = {"RDQ_CHILD": ChildSpec(1, 2, lifeline_fd=5, report_fd=6).to_env()}
    assert as_child(config, env).engine.instance_id == "p-1"
    assert as_child(config, {}) is config
    for bad in ("{", '{"index": 2, "count": 2}', '{"nope": 1}'):
        with pytest.raises(ConfigError, match="RDQ_CHILD"):
            as_child(config, {"RDQ_CHILD": bad})


def test_processes_is_a_count_or_auto() -> None:
    assert process_count(parse_config(_tree(engine={"processes": 4}))) == 4
    assert process_count(parse_config(_tree(engine={"processes": "auto"}))) == cores()  # tests/test_cores.py
    for bad in (0, 257, "two", True):
        with pytest.raises(ConfigError, match=r"engine\.processes"):
            parse_config(_tree(engine={"processes": bad}))
    proc = subprocess.run([sys.executable, "-m", "bridge.cli", "run", "--config", "x.yaml", "--processes", "0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "processes is a number from 1 to 256 or auto" in proc.stderr


# ---- the supervisor on a real broker ---------------------------------------------------------------------------


def _get(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            body = response.read().decode()
            return response.status, json.loads(body) if path != "/metrics" else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())
    except OSError:
        return 0, None


def _wait(predicate: Any, within: float, what: str, proc: BridgeProcess) -> Any:
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline or not proc.alive:
            raise AssertionError(f"timed out waiting for {what}; supervisor alive: {proc.alive}\n{proc.tail(60)}")
        time.sleep(0.2)


def _children(port: int) -> dict[str, Any]:
    """The supervisor's view of each child (empty until it answers)."""
    status, body = _get(port, "/healthz")
    return body["children"] if status == 200 else {}


def _child_pids(port: int) -> dict[str, int | None]:
    return {i: c["pid"] for i, c in _children(port).items()}


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by whoever adopted it counts: it holds nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state == "Z"


def _supervised(kafka: KafkaEnv, tmp_path: Path, unique: str, queues: dict[str, Any], **extra: Any) -> BridgeConfig:
    return kafka_config(kafka.bootstrap_servers, tmp_path, unique, queues,
                        kafka={"topic_partitions": 4},
                        admin={"topic": f"admin-{unique}", "reply_topic": f"replies-{unique}", "auth": "none"},
                        telemetry={"port": free_port()}, **extra)


@pytest.mark.kafka
@pytest.mark.slow
def test_two_processes_share_the_partitions_and_a_child_killed_with_sigkill_loses_nothing(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    rng = random.Random(2525)
    topic, dlq = f"in-{unique}", f"dlq-{unique}"
    log_path = tmp_path / "example.log"
    config = _supervised(kafka, tmp_path, unique, {
        "mixed": {"handler": "flaky", "sources": [topic], "dlq_topic": dlq, "max_attempts": 4, "lease": "3s",
                  "backoff": {"kind": "fixed", "base": "50ms"}}},
        engine={"processes": 2, "instance_id": f"pod-{unique}"})
    port = config.telemetry.port
    assert port is not None
    ensure_topics(config)
    payloads = mixed_payloads(2000, rng)
    hopeless = sum(b'"fail": 99' in p for p in payloads)
    supervisor = BridgeProcess(config, tmp_path / "bridge.yaml", {"RDQ_EXAMPLE_LOG": str(log_path)}).start()
    try:
        ready = _wait(lambda: _get(port, "/readyz")[0] == 200, 90, "both children ready", supervisor)
        assert ready
        feeder = threading.Thread(target=produce_slowly, args=(config, topic, payloads, 250))
        feeder.start()
        time.sleep(3)
        victim = _child_pids(port)["0"]
        assert victim is not None
        os.kill(victim, signal.SIGKILL)  # mid-work: its partitions move to child 1, then come back
        _wait(lambda: _children(port)["0"]["restarts"] == 1, 30, "the restart", supervisor)
        _wait(lambda: _child_pids(port)["0"] not in (None, victim), 30, "a new child 0", supervisor)
        feeder.join()

        result: Any = wait_accounted(lambda: account(config, log_path, topic, dlq, len(payloads)), within=120)
        assert not result.missing, result.summary()
        assert result.duplicate_dead == 0 and len(set(result.dead)) >= hopeless, result.summary()
        _wait(lambda: _get(port, "/readyz")[0] == 200, 60, "ready again", supervisor)

        # One /metrics: each child's series labelled with its process, and the supervisor's own.
        metrics = _get(port, "/metrics")[1]
        for process in ("0", "1"):
            assert f'rdq_ready{{process="{process}"}} 1.0' in metrics, metrics
        assert 'rdq_supervisor_restarts_total{process="0"} 1.0' in metrics
        assert "rdq_supervisor_children 2.0" in metrics
        # Every child answers the admin topic as its own instance.
        stats = subprocess.run([sys.executable, "-m", "bridge.cli", "stats", "--config", str(supervisor.path),
                                "--json", "--instances", "2", "--timeout", "20"],
                               capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert stats.returncode == 0, stats.stderr
        assert sorted(r["instance"] for r in json.loads(stats.stdout)) == [f"pod-{unique}-0", f"pod-{unique}-1"]
        pids = [p for p in _child_pids(port).values() if p is not None]
        assert supervisor.terminate(timeout=60) == 0, supervisor.tail(60)
        assert all(_gone(p) for p in pids)
        log = supervisor.tail(400)
        assert "child 0 stopped (exit 0)" in log and "child 1 stopped (exit 0)" in log
        # The children share the supervisor's stderr: each of their lines says which child wrote it.
        lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        assert {line.get("child") for line in lines if line["logger"] == "bridge.service"} == {0, 1}, log
    finally:
        supervisor.kill()


@pytest.mark.kafka
@pytest.mark.slow
def test_a_crash_looping_child_backs_off_unready_and_a_killed_supervisor_leaves_no_child(
        kafka: KafkaEnv, tmp_path: Path, unique: str) -> None:
    topic = f"in-{unique}"
    log_path = tmp_path / "example.log"
    config = _supervised(kafka, tmp_path, unique, {"q": {"handler": "ok", "sources": [topic]}},
                         engine={"processes": 2, "handler_modules": ["handlers", "tests.crash_child"]})
    port = config.telemetry.port
    assert port is not None
    ensure_topics(config)
    supervisor = BridgeProcess(config, tmp_path / "bridge.yaml",
                               {"RDQ_EXAMPLE_LOG": str(log_path), "RDQ_CRASH_CHILD": "1"}).start()
    try:
        _wait(lambda: _children(port).get("1", {}).get("restarts", 0) >= 3, 60, "three restarts", supervisor)
        log = supervisor.tail(400)
        for delay in ("1.0", "2.0", "4.0"):  # the backoff grows while the child dies young
            assert f"restarting in {delay} s" in log, log
        status, body = _get(port, "/readyz")
        assert status == 503 and body["children"]["1"]["ready"] is False, body
        assert body["children"]["0"]["ready"] is True, body
        # Its sibling runs on, with every partition.
        produce_records = [(f"k{i}".encode(), b"{}", []) for i in range(200)]
        from tests.kafka_helpers import produce

        produce(config, topic, produce_records)
        _wait(lambda: log_path.exists() and len(log_path.read_text().splitlines()) >= 200, 60, "200 successes",
              supervisor)

        # SIGKILL the supervisor: its children see their lifeline close and stop by themselves.
        survivor = _child_pids(port)["0"]
        assert survivor is not None
        supervisor.proc.send_signal(signal.SIGKILL)
        supervisor.proc.wait(10)
        deadline = time.monotonic() + config.engine.grace_period + 20
        while not _gone(survivor) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(survivor), supervisor.tail(40)
        assert "the supervisor is gone: child 0 stopping" in supervisor.tail(200)
    finally:
        supervisor.kill()


@pytest.mark.kafka
@pytest.mark.slow
def test_more_processes_than_partitions_leave_a_child_idle_and_ready(kafka: KafkaEnv, tmp_path: Path,
                                                                      unique: str) -> None:
    """Two children, one source partition: one child owns it, the other owns nothing and is ready all the same
    (an idle child is not a fault); every record is handled."""
    topic = f"in-{unique}"
    log_path = tmp_path / "example.log"
    config = _supervised(kafka, tmp_path, unique, {"q": {"handler": "ok", "sources": [topic]}},
                         engine={"processes": 2})
    config = config.model_copy(update={"kafka": config.kafka.model_copy(update={"topic_partitions": 1})})
    port = config.telemetry.port
    assert port is not None
    ensure_topics(config)
    supervisor = BridgeProcess(config, tmp_path / "bridge.yaml", {"RDQ_EXAMPLE_LOG": str(log_path)}).start()
    try:
        _wait(lambda: _get(port, "/readyz")[0] == 200, 90, "both children ready", supervisor)
        from tests.kafka_helpers import produce

        produce(config, topic, [(f"k{i}".encode(), b"{}", []) for i in range(50)])
        _wait(lambda: log_path.exists() and len(log_path.read_text().splitlines()) >= 50, 60, "50 successes",
              supervisor)
        metrics = _get(port, "/metrics")[1]
        consumed = {p: f'rdq_records_consumed_total{{process="{p}",queue="q"}} 50.0' in metrics for p in "01"}
        assert sorted(consumed.values()) == [False, True], metrics  # one child did all of it
        status, body = _get(port, "/readyz")
        assert status == 200 and all(c["ready"] for c in body["children"].values()), body
        assert supervisor.terminate(timeout=60) == 0, supervisor.tail(60)
    finally:
        supervisor.kill()


def test_a_taken_telemetry_port_fails_the_start_before_any_child(tmp_path: Path, unique: str) -> None:
    """The supervisor binds its /metrics and /readyz port before it spawns a child: a taken port ends `rdq run` at
    once with a clear error (exit 2), and no child ever started (none joined the group to leave it again)."""
    import socket

    import yaml

    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        config = kafka_config("127.0.0.1:1", tmp_path, unique, {"q": {"handler": "ok", "sources": [f"in-{unique}"]}},
                              telemetry={"port": port}, engine={"processes": 2})
        path = tmp_path / "bridge.yaml"
        path.write_text(yaml.safe_dump(config.file_tree()))
        run = subprocess.run([sys.executable, "-m", "bridge.cli", "run", "--config", str(path)],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
    finally:
        taken.close()
    assert run.returncode == 2, run.stderr
    assert f"rdq: telemetry: cannot listen on 127.0.0.1:{port}" in run.stderr, run.stderr
    assert "child 0 started" not in run.stderr and "Traceback" not in run.stderr, run.stderr
