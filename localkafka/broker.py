"""Resolve, format, start and stop a single-node KRaft broker from Maven Central jars."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

KAFKA_VERSION = "4.4.0"
_HERE = Path(__file__).resolve().parent
_STARTED_LINE = "Kafka Server started"
_JVM_OPTS = [
    "-Xms256m",
    "-Xmx512m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-Djava.awt.headless=true",
]


class BrokerError(RuntimeError):
    """The local broker could not be resolved, formatted or started; the message says why."""


def cache_root() -> Path:
    """Where resolved jars live: outside git, shared by every checkout and every run."""
    base = os.environ.get("RDQ_KAFKA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rdq-bridge", "kafka"
    )
    return Path(base) / KAFKA_VERSION


def resolve_jars() -> Path:
    """Resolve the broker's jars once (Maven), then reuse them. Returns the folder of jars."""
    libs = cache_root() / "libs"
    marker = libs / ".complete"
    if marker.exists():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("Maven (`mvn`) is not on PATH: it is needed once to fetch the Kafka broker jars")
    staging = Path(tempfile.mkdtemp(prefix="libs-", dir=_ensure_dir(cache_root())))
    cmd = [
        mvn, "-q", "-B", "-f", str(_HERE / "pom.xml"),
        f"-Dkafka.version={KAFKA_VERSION}",
        "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={staging}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
        shutil.rmtree(staging, ignore_errors=True)
        raise BrokerError(f"Maven could not resolve Kafka {KAFKA_VERSION}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    (staging / ".complete").write_text(KAFKA_VERSION)
    # Rename is atomic: a concurrent or interrupted resolve never leaves a half-filled libs folder.
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)
    return libs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise BrokerError("Java 17+ (`java`) is not on PATH: the Kafka broker needs it")
    return java


class LocalBroker:
    """One broker+controller process on 127.0.0.1. `stop()` then `start()` keeps ports and data."""

    def __init__(self, workdir: Path | None = None, port: int | None = None, controller_port: int | None = None,
                 advertised_port: int | None = None):
        """`advertised_port`: the port clients are told to use (a proxy in front of this broker, for fault
        tests); the broker's own port by default."""
        self.workdir = _ensure_dir(workdir or Path(tempfile.mkdtemp(prefix="rdq-kafka-")))
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port
        self.controller_port = controller_port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "broker.log"

    def _properties(self) -> Path:
        data = self.workdir / "data"
        lines = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.advertised_port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(data),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            # The bridge's changelog writes in transactions: a small coordinator topic starts fast on one broker,
            # and a crashed producer's open transaction is aborted within ~1 s of its timeout (default 10 s).
            "transaction.state.log.num.partitions": "4",
            "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
        }
        path = self.workdir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        return path

    def _run_tool(self, libs: Path, *args: str) -> str:
        cmd = [_java(), "-cp", f"{libs}/*", f"-Dlog4j2.configurationFile={_HERE / 'log4j2.xml'}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise BrokerError(f"{' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return proc.stdout.strip()

    def _format_once(self, libs: Path, props: Path) -> None:
        if (self.workdir / "data" / "meta.properties").exists():
            return
        cluster_id = self._run_tool(libs, "kafka.tools.StorageTool", "random-uuid").splitlines()[-1]
        # share.version=2: share groups with their dead-letter queue (KIP-1191, Kafka 4.4), for `rdq import` tests.
        self._run_tool(libs, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props),
                       "--feature", "share.version=2")

    def start(self, timeout: float = 90.0) -> LocalBroker:
        if self.process is not None and self.process.poll() is None:
            return self
        began = time.monotonic()
        libs = resolve_jars()
        props = self._properties()
        self._format_once(libs, props)
        log = self.log_path.open("ab")
        offset = self.log_path.stat().st_size
        cmd = [
            _java(), *_JVM_OPTS, "-cp", f"{libs}/*",
            f"-Dlog4j2.configurationFile={_HERE / 'log4j2.xml'}", "kafka.Kafka", str(props),
        ]  # fmt: skip
        # Own session: a terminal's Ctrl-C reaches the bridge first; the launcher stops the broker after it.
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self._wait_started(offset, began + timeout)
        self.startup_seconds = time.monotonic() - began
        return self

    def _wait_started(self, log_offset: int, deadline: float) -> None:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrokerError(f"Kafka exited with {self.process.returncode}:\n{self._log_tail(log_offset)}")
            if _STARTED_LINE in self._log_tail(log_offset) and self._port_open():
                return
            time.sleep(0.1)
        self.stop()
        raise BrokerError(f"Kafka did not start within the timeout:\n{self._log_tail(log_offset)}")

    def _log_tail(self, offset: int) -> str:
        with self.log_path.open("rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")[-4000:]

    def _port_open(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
            return True
        return False

    def stop(self, timeout: float = 30.0) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, for fault tests: the data survives, a later start() recovers it."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def rss_bytes(self) -> int:
        """Resident memory of the broker process (Linux /proc)."""
        if self.process is None:
            return 0
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
