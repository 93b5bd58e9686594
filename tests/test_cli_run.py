"""`rdq run` and `make run`'s launcher as processes: start, answer signals, stop cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest
import yaml

from localkafka.broker import free_port
from tests.conftest import KafkaEnv, write_config

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parent.parent


class Output:
    """Collects a process's stream on a thread, so a test can wait for a line without blocking."""

    def __init__(self, stream: IO[str]) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.text += line

    def wait_for(self, needle: str, proc: subprocess.Popen[str], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} not seen; output:\n{self.text}")
            time.sleep(0.05)

    def finish(self) -> str:
        self._thread.join(10)
        return self.text


def _config(tmp_path: Path, kafka_servers: str, unique: str) -> Path:
    return write_config(tmp_path / "bridge.yaml", {
        "kafka": {"bootstrap_servers": kafka_servers, "group_id": f"g-{unique}"},
        "store": {"path": str(tmp_path / "rdq.db")},
        "queues": {"q": {"handler": "ok", "sources": [f"src-{unique}"]}},
        "admin": {"topic": f"admin-{unique}", "reply_topic": f"replies-{unique}", "auth": "none"},
    })


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_rdq_run_starts_and_stops_gracefully(kafka: KafkaEnv, tmp_path: Path, unique: str, sig: int) -> None:
    config = _config(tmp_path, kafka.bootstrap_servers, unique)
    proc = subprocess.Popen([sys.executable, "-m", "bridge.cli", "run", "--config", str(config)],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stderr is not None
    err = Output(proc.stderr)
    try:
        err.wait_for("started", proc)
        # The config's admin topic was never created: the bridge says so and keeps running.
        err.wait_for("does not exist", proc)
        assert proc.poll() is None
        proc.send_signal(sig)
        code = proc.wait(30)
        text = err.finish()
        assert code == 0, text
        assert "stopped" in text
        assert (tmp_path / "rdq.db").exists()
    finally:
        proc.kill()


def test_a_stop_that_hangs_is_cancelled_named_and_the_process_exits(kafka: KafkaEnv, tmp_path: Path,
                                                                    unique: str) -> None:
    """uvicorn's rule: drain within a bound, then cancel. The consumer's stop is blocked in a thread for an hour
    (tests/hang_stop.py; stop budget 3 s): the bridge names the stuck part with its stack, closes the store and
    exits 1, instead of waiting for ever on the thread (asyncio.run's executor shutdown would)."""
    config = _config(tmp_path, kafka.bootstrap_servers, unique)
    tree = yaml.safe_load(config.read_text())
    tree["engine"] = {"handler_modules": ["handlers", "tests.hang_stop"]}
    config.write_text(yaml.safe_dump(tree))
    proc = subprocess.Popen([sys.executable, "-m", "bridge.cli", "run", "--config", str(config)],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "RDQ_HANG_STOP": "1"})
    assert proc.stderr is not None
    err = Output(proc.stderr)
    try:
        err.wait_for("started", proc)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        text = err.finish()
        assert code == 1, text
        assert "rdq-consumer still stopping after 3 s: cancelled" in text, text
        assert "_blocked_in_a_client_call" in text, text  # where it was stuck
        assert "rdq bridge" in text and "stopped" in text.split("still stopping", 1)[1], text  # store closed
        assert "graceful stop overran" in text, text
    finally:
        proc.kill()


def test_bad_config_fails_at_start_naming_file_and_field(tmp_path: Path) -> None:
    path = write_config(tmp_path / "bad.yaml", {"kafka": {"bootstrap_servers": "x:1"},
                                                 "queues": {"q": {"handler": "ok", "lease": "-5s"}}})
    proc = subprocess.run([sys.executable, "-m", "bridge.cli", "run", "--config", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2
    assert str(path) in proc.stderr and "queues.q.lease" in proc.stderr
    assert not (tmp_path / "rdq.db").exists()


@pytest.mark.parametrize("how", ["ctrl-c", "sigint-to-launcher", "sigterm-to-make"])
def test_make_run_stops_the_bridge_then_the_broker_on_a_signal(tmp_path: Path, unique: str, how: str) -> None:
    """`make run` is `python -m localkafka dev`: broker + topics + bridge. Each way a signal arrives stops the
    bridge gracefully (it logs "stopped"), then the broker: a terminal's Ctrl-C (SIGINT to the whole group), a
    SIGINT to the launcher's own pid, a SIGTERM to `make`'s own pid (make passes SIGTERM on to its child)."""
    port = free_port()
    config = _config(tmp_path, f"127.0.0.1:{port}", unique)
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "RDQ_KAFKA__BOOTSTRAP_SERVERS")}
    launch = ["--config", str(config), "--port", str(port), "--dir", str(tmp_path / "kafka")]
    if how == "sigterm-to-make":
        command = ["make", "-s", "run", f"CONFIG={config}", f"RUN_ARGS={' '.join(launch[2:])}"]
    else:
        command = [sys.executable, "-m", "localkafka", "dev", *launch]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    assert proc.stderr is not None and proc.stdout is not None
    err, std = Output(proc.stderr), Output(proc.stdout)
    try:
        err.wait_for("started: store", proc, timeout=180)
        broker_pid = _broker_pid(tmp_path / "kafka")
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT if how == "sigint-to-launcher" else signal.SIGTERM)
        # make waits for its child, then ends by the signal it got (as GNU make does); the launcher exits 0.
        assert proc.wait(60) == (-signal.SIGTERM if how == "sigterm-to-make" else 0), err.finish()
        out, text = std.finish(), err.finish()
        assert "stopping the local kafka broker" in out
        assert "created:" in out
        assert "stopped" in text.split("started: store", 1)[1], text  # the bridge's own graceful stop
        deadline = time.monotonic() + 30
        while _alive(broker_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(broker_pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _broker_pid(workdir: Path) -> int:
    props = str(workdir / "server.properties")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if props.encode() in cmdline:
                return int(entry.name)
    raise AssertionError("broker process not found")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def test_compose_file_uses_apache_kafka_same_major_and_builds_the_bridge() -> None:
    from localkafka import KAFKA_VERSION

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    image = compose["services"]["kafka"]["image"]
    assert image.startswith("apache/kafka:") and image.split(":")[1].split(".")[0] == KAFKA_VERSION.split(".")[0]
    assert compose["services"]["bridge"]["build"] == "."
    assert "./config:/config:ro" in compose["services"]["bridge"]["volumes"]
