"""SIGKILL a process that stores and completes tasks, many times: every write it acknowledged is there after.

What this proves: the store answers a caller only after its transaction committed, and a process killed at any
moment (mid group commit, mid checkpoint) leaves a file that opens, passes `integrity_check`, and holds every
acknowledged submit and every acknowledged outcome exactly as acknowledged (the attempt with that number and
outcome; a terminal status unchanged).

What it does not prove: durability against power loss or a kernel crash. SIGKILL keeps the OS page cache, so a
write SQLite handed to the kernel survives even without fsync: this test would pass with `synchronous=OFF` too.
That guarantee rests on SQLite's `synchronous=FULL` (checked here to be what the process runs with) and on the
disk honouring fsync; testing it needs a VM or a fault-injecting block device, not available here.
"""

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

from bridge.store.history import with_history_functions

ROOT = Path(__file__).resolve().parent.parent
OUTCOME_OF = {"PENDING": "RETRYABLE_FAILURE", "SUCCEEDED": "SUCCESS", "DEAD": "PERMANENT_FAILURE"}


def run_until_killed(db: Path, seed: int, rng: random.Random) -> list[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.crash_worker", str(db), str(seed)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY synchronous=2"  # FULL
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
    finished: dict[str, list[tuple[str, int]]] = {}
    kills = 25
    journaled = 0
    for round_no in range(kills):
        journal: dict[int, int] = {}  # partition -> the highest offset of an acknowledged journal write
        for line in run_until_killed(db, round_no, rng):
            kind, task_id, *rest = line.split()
            if kind == "J":
                journal[int(task_id)] = int(rest[0])
                journaled += 1
            elif kind == "S":
                submitted.add(task_id)
            elif kind == "D":
                status, attempt_no = rest[0].split(".")[-1], int(rest[1])
                finished.setdefault(task_id, []).append((status, attempt_no))
        check_store(db, submitted, finished)
        check_journal(db, f"run-{round_no}", journal)
    print(f"{kills} kills: {len(submitted)} submits, {len(finished)} outcomes and {journaled} journal writes "
          "acknowledged, all found")
    assert len(submitted) > 500, "the worker should have stored many tasks between kills"
    assert len(finished) > 100
    assert journaled > 100


def check_journal(db: Path, run_id: str, acknowledged: dict[int, int]) -> None:
    """Every acknowledged journal write of the killed run is there (its range, or a later one of the partition):
    a handler that kills the process is recognised after it, though such a commit alone is not fsync'd."""
    conn = sqlite3.connect(db)
    rows = dict(conn.execute("SELECT partition, hi FROM inflight WHERE run_id = ?", (run_id,)).fetchall())
    conn.close()
    for partition, hi in acknowledged.items():
        assert rows.get(partition, -1) >= hi, (run_id, partition, hi, rows)


def check_store(db: Path, submitted: set[str], finished: dict[str, list[tuple[str, int]]]) -> None:
    conn = with_history_functions(sqlite3.connect(db))  # attempt_history reads packed histories through it
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = {r[0]: r[1:] for r in conn.execute("SELECT id, status, attempt_count FROM tasks")}
    attempts: dict[str, list[tuple[int, str, int]]] = {}
    for task_id, attempt_no, outcome, redrive_no in conn.execute(
            "SELECT task_id, attempt_no, outcome, redrive_no FROM attempt_history ORDER BY seq"):
        attempts.setdefault(task_id, []).append((attempt_no, outcome, redrive_no))
    conn.close()
    missing = submitted - rows.keys()
    assert not missing, f"{len(missing)} acknowledged tasks lost, e.g. {sorted(missing)[:3]}"
    for task_id, outcomes in finished.items():
        now_status, count = rows[task_id]
        history = attempts[task_id]
        for status, attempt_no in outcomes:
            # Exactly what was acknowledged is there: that attempt number with that outcome.
            assert (attempt_no, OUTCOME_OF[status], 0) in history, (task_id, status, attempt_no, history)
            assert count >= attempt_no, (task_id, count, attempt_no)  # attempt counts never go back
        last_status, last_attempt = outcomes[-1]
        if last_status in ("SUCCEEDED", "DEAD"):
            assert (now_status, count) == (last_status, last_attempt), (task_id, outcomes, now_status, count)
    for task_id, (status, count) in rows.items():
        running = 1 if status == "IN_FLIGHT" else 0
        assert count == len(attempts.get(task_id, [])) + running, (task_id, status, count, attempts.get(task_id))
