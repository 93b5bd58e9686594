"""SIGKILL a process that stores and completes tasks, many times: every write it acknowledged is there after."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RANK = {"PENDING": 0, "IN_FLIGHT": 0, "SUCCEEDED": 1, "DEAD": 1}


def run_until_killed(db: Path, seed: int, rng: random.Random) -> list[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.crash_worker", str(db), str(seed)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    time.sleep(rng.uniform(0.05, 0.6))
    os.kill(proc.pid, signal.SIGKILL)
    lines = proc.stdout.read().splitlines()  # what it printed before dying: all acknowledged
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return lines


@pytest.mark.slow
def test_acknowledged_writes_survive_sigkill(tmp_path: Path) -> None:
    db = tmp_path / "rdq.db"
    rng = random.Random(20261129)
    submitted: set[str] = set()
    finished: dict[str, tuple[str, int]] = {}
    kills = 25
    for round_no in range(kills):
        for line in run_until_killed(db, round_no, rng):
            kind, task_id, *rest = line.split()
            if kind == "S":
                submitted.add(task_id)
            elif kind == "D":
                status, attempt_no = rest[0].split(".")[-1], int(rest[1])
                finished[task_id] = (status, attempt_no)
        check_store(db, submitted, finished)
    print(f"{kills} kills: {len(submitted)} submits and {len(finished)} outcomes acknowledged, all found")
    assert len(submitted) > 500, "the worker should have stored many tasks between kills"
    assert len(finished) > 100


def check_store(db: Path, submitted: set[str], finished: dict[str, tuple[str, int]]) -> None:
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = {r[0]: r[1:] for r in conn.execute("SELECT id, status, attempt_count FROM tasks")}
    attempts: dict[str, list[tuple[int, str]]] = {}
    for task_id, attempt_no, outcome in conn.execute("SELECT task_id, attempt_no, outcome FROM attempts ORDER BY seq"):
        attempts.setdefault(task_id, []).append((attempt_no, outcome))
    conn.close()
    missing = submitted - rows.keys()
    assert not missing, f"{len(missing)} acknowledged tasks lost, e.g. {sorted(missing)[:3]}"
    for task_id, (status, attempt_no) in finished.items():
        now_status, count = rows[task_id]
        history = attempts[task_id]
        # An acknowledged outcome is durable: the task is at least that far along, with that attempt recorded.
        assert RANK[now_status] >= RANK[status] or status == "PENDING", (task_id, status, now_status)
        assert any(no == attempt_no for no, _ in history), (task_id, attempt_no, history)
        if status in ("SUCCEEDED", "DEAD"):
            assert now_status == status, f"{task_id}: acknowledged {status}, found {now_status}"
    for task_id, (status, count) in rows.items():
        running = 1 if status == "IN_FLIGHT" else 0
        assert count == len(attempts.get(task_id, [])) + running, (task_id, status, count, attempts.get(task_id))
