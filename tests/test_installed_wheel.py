"""The bridge as users install it: a wheel built from the checkout, installed into a fresh virtualenv outside it,
and `rdq run --processes 2` from there on the real broker (a record succeeds, one dead-letters). Every other test
imports the editable checkout, so a file the wheel forgets (the schema migrations once) is seen only here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from bridge.config import parse_config
from bridge.kafka_clients import ensure_topics
from tests.conftest import KafkaEnv
from tests.kafka_helpers import example_log, produce, read_dlq

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent


def _build_wheel(out: Path) -> Path:
    """Built from what the Dockerfile copies, into a fresh folder: a build/ or egg-info left in the checkout by
    an earlier build would otherwise lend the wheel files its package data does not name."""
    source = out / "source"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    for package in ("bridge", "handlers", "localkafka"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
                   check=True, cwd=out, timeout=600)
    (wheel,) = out.glob("rdq_bridge-*.whl")
    return wheel


def _fresh_venv(where: Path, wheel: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=900, cwd=where)
    return where / "bin" / "rdq"


def test_the_wheel_carries_every_schema_migration(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.name for p in (ROOT / "bridge" / "store" / "sql" / "migrations").glob("*.sql")}
    assert shipped, "the checkout has migrations"
    assert {f"bridge/store/sql/migrations/{n}" for n in shipped} <= names
    assert "bridge/store/sql/queries.sql" in names


def test_installed_wheel_runs_end_to_end(kafka: KafkaEnv, tmp_path: Path, unique: str,
                                         example_log_path: Path) -> None:
    (tmp_path / "dist").mkdir()
    wheel = _build_wheel(tmp_path / "dist")
    rdq = _fresh_venv(tmp_path / "venv", wheel)
    workdir = tmp_path / "elsewhere"  # outside the checkout: nothing can be imported from it
    workdir.mkdir()
    tree = {
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers, "group_id": f"g-{unique}", "topic_partitions": 1},
        "store": {"path": str(workdir / "rdq.db")},
        "engine": {"handler_modules": ["handlers.examples"], "sweep_interval": "100ms"},
        "queues": {
            "good": {"handler": "ok", "sources": [f"good-{unique}"]},
            "bad": {"handler": "permanent", "sources": [f"bad-{unique}"], "dlq_topic": f"bad-{unique}.dlq"},
        },
        "admin": {"topic": f"admin-{unique}", "reply_topic": f"replies-{unique}",
                  "auth": {"keys": {"k1": "an-installed-secret-of-32-bytes-or-more"}}},
    }
    config_path = workdir / "bridge.yaml"
    config_path.write_text(yaml.safe_dump(tree))
    config = parse_config(tree, "<test>")
    ensure_topics(config)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(rdq.parent / "python"), "-c", "import bridge; print(bridge.__file__)"],
                           capture_output=True, text=True, cwd=workdir, env=env, check=True).stdout
    assert str(tmp_path / "venv") in where and str(ROOT) not in where, where
    log = (workdir / "bridge.log").open("wb")
    # Two processes: the supervisor's children are started from the installed package too (`python -m
    # bridge.cli` of the venv's interpreter), each with its own store file.
    proc = subprocess.Popen([str(rdq), "run", "--config", str(config_path), "--processes", "2"], cwd=workdir,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        produce(config, f"good-{unique}", [(b"k1", b'{"n": 1}', [])])
        produce(config, f"bad-{unique}", [(b"k2", b'{"n": 2}', [])])
        dead = read_dlq(kafka.bootstrap_servers, f"bad-{unique}.dlq", expect=1, timeout=90)
        assert len(dead) == 1 and dead[0].key == b"k2"
        assert dead[0].value["task"]["queue"] == "bad"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not example_log(example_log_path):
            time.sleep(0.2)
        succeeded = example_log(example_log_path)
        assert [(e["handler"], f"good-{unique}/" in e["source"]) for e in succeeded] == [("ok", True)], succeeded
        assert proc.poll() is None, (workdir / "bridge.log").read_text(errors="replace")
        assert (workdir / "rdq-0.db").exists() and (workdir / "rdq-1.db").exists()
        _console_shows_the_dead_task(rdq, config_path, workdir, env)
        proc.terminate()
        assert proc.wait(60) == 0, (workdir / "bridge.log").read_text(errors="replace")
        text = (workdir / "bridge.log").read_text(errors="replace")
        assert "child 0 stopped (exit 0)" in text and "child 1 stopped (exit 0)" in text, text
    finally:
        proc.kill()
        log.close()


def _console_shows_the_dead_task(rdq: Path, config_path: Path, workdir: Path, env: dict[str, str]) -> None:
    """`rdq console` of the installed package: its templates and static files shipped in the wheel."""
    console = subprocess.Popen([str(rdq), "console", "--config", str(config_path), "--port", "0"], cwd=workdir,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert console.stdout is not None
        line = console.stdout.readline()
        assert line.startswith("console: http://127.0.0.1:"), (line, console.poll())
        login = line.removeprefix("console: ").strip()
        base = login.split("/?")[0]
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            opener.open(login, timeout=30)
            raise AssertionError("the login URL did not redirect")
        except urllib.error.HTTPError as e:
            assert e.code == 303
            cookie = e.headers["Set-Cookie"].split(";")[0]
        deadline, page = time.monotonic() + 60, ""
        while time.monotonic() < deadline and '<strong id="dead-total">1</strong>' not in page:
            request = urllib.request.Request(f"{base}/dead", headers={"Cookie": cookie})
            page = urllib.request.urlopen(request, timeout=30).read().decode()
        assert '<strong id="dead-total">1</strong>' in page, page[-3000:]
        css = urllib.request.urlopen(f"{base}/static/console.css", timeout=10)
        assert css.status == 200 and b"rdq console" in css.read()
    finally:
        console.terminate()
        assert console.wait(15) == 0, console.stderr.read() if console.stderr else ""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_a_failed_start_exits_with_a_clear_message(tmp_path: Path) -> None:
    """A store that cannot open ends `rdq run` non-zero at once (it once hung on aiosqlite's thread)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    tree = {"kafka": {"bootstrap_servers": "127.0.0.1:1"}, "store": {"path": str(blocker / "rdq.db")},
            "queues": {"q": {"handler": "ok", "sources": ["s"]}}}
    config_path = tmp_path / "bridge.yaml"
    config_path.write_text(yaml.safe_dump(tree))
    done = subprocess.run([sys.executable, "-m", "bridge.cli", "run", "--config", str(config_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 3, done.stderr
    assert "rdq: store:" in done.stderr and "cannot open the store" in done.stderr


_BROKEN_INSTALL = """
import asyncio, sys
import bridge.store.database
from bridge.store.database import StoreError
from bridge.store.tasks import Store

def missing():
    raise FileNotFoundError("site-packages/bridge/store/sql/migrations")

bridge.store.database.migrations = missing
try:
    asyncio.run(Store.open(sys.argv[1]))
except StoreError as e:
    print("refused:", e)
    sys.exit(3)
"""


def test_a_store_that_cannot_migrate_refuses_and_the_process_exits(tmp_path: Path) -> None:
    """The wheel without its migrations: Store.open raised FileNotFoundError and left aiosqlite's thread running,
    so the process never exited. Now a StoreError, the connection closed, the process gone."""
    done = subprocess.run([sys.executable, "-c", _BROKEN_INSTALL, str(tmp_path / "rdq.db")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 3, done.stderr
    assert "FileNotFoundError" in done.stdout and "migrations" in done.stdout
