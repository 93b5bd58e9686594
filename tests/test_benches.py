"""Every bench row runs once at a tiny size, on the test broker, so that a bench that rots (hangs, breaks on a
changed API) fails CI. The figures are printed, not asserted and not recorded (RDQ_BENCH_SMOKE=1); the real
figures come from `make bench` at production sizes (bench/RESULTS.md).

Not here: bench/bench_broker.py (it times the local-broker tooling itself, starting a broker from an empty jar
cache, i.e. a download); bench/faults.py and bench/nemesis.py, which CI runs as `make faults`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import KafkaEnv

ROOT = Path(__file__).resolve().parent.parent

ROWS = {
    "engine-failures": ["bench.bench_engine", "failures", "--n", "300"],
    "engine-retry": ["bench.bench_engine", "retry", "--n", "300"],
    "engine-scale": ["bench.bench_engine", "scale", "--sizes", "2000", "--claims", "20"],
    "engine-binding": ["bench.bench_engine", "binding", "--n", "300"],
    "engine-lane": ["bench.bench_engine", "lane", "--n", "300"],
    "kafka-happy": ["bench.bench_kafka", "happy", "--n", "600", "--runs", "1"],
    "kafka-bookkeeping": ["bench.bench_kafka", "bookkeeping", "--n", "600", "--runs", "1"],
    "kafka-failure": ["bench.bench_kafka", "failure", "--n", "300", "--runs", "1"],
    "kafka-dlq": ["bench.bench_kafka", "dlq", "--n", "100", "--runs", "1"],
    "kafka-e2e": ["bench.bench_kafka", "e2e", "--n", "60", "--runs", "1"],
    "kafka-ordering": ["bench.bench_kafka", "ordering", "--n", "600", "--runs", "1"],
    "kafka-lowrate": ["bench.bench_lowrate", "--n", "40", "--runs", "1"],
    "changelog-restore": ["bench.bench_changelog", "restore", "--n", "300"],
    "changelog-restore-partitions": ["bench.bench_changelog", "restore", "--n", "300", "--partitions", "3"],
    "changelog-apply": ["bench.bench_changelog", "apply", "--n", "2400"],
    "changelog-decode": ["bench.bench_changelog", "decode", "--n", "300"],
    "changelog-overhead": ["bench.bench_changelog", "overhead", "--n", "300"],
    "changelog-ready": ["bench.bench_changelog", "ready", "--n", "1"],
    "processes": ["bench.bench_processes", "all", "--n", "300", "--runs", "1"],
    "tracing": ["bench.bench_tracing", "--n", "600"],
    "admin": ["bench.bench_admin", "--n", "40", "--runs", "1", "--rate", "1000"],
    "console": ["bench.bench_console", "--n", "40", "--runs", "1"],
}
BOUND = 240  # seconds: a tiny run that takes longer is a bench that would hang at full size


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("row", sorted(ROWS))
def test_every_bench_runs_at_a_tiny_size(kafka: KafkaEnv, row: str, tmp_path: Path) -> None:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "RDQ_BENCH_SMOKE": "1"}
    results = ROOT / "bench" / "RESULTS.md"
    before = results.read_bytes()
    try:
        proc = subprocess.run([sys.executable, "-m", *ROWS[row]], capture_output=True, text=True, cwd=ROOT, env=env,
                              timeout=BOUND)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{row} did not finish within {BOUND} s at a tiny size:\n{e.stdout}\n{e.stderr}") from e
    assert proc.returncode == 0, f"{row} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "(smoke run:" in proc.stdout, proc.stdout  # it reached its figures
    assert results.read_bytes() == before  # a smoke run records nothing


@pytest.mark.parametrize(("header", "least"), [("| benchmark (command) |", 50), ("| goal (issue 25) |", 10)])
def test_every_figure_of_the_readmes_bench_tables_is_a_line_of_results(header: str, least: int) -> None:
    """The README quotes bench/RESULTS.md; a figure of its tables (a count with thousands separators, as 20,799)
    that RESULTS.md does not hold was made up, or its row was lost from the file (once replaced whole by a fault
    table instead of appended to). Two tables: every run (the log) and where each goal stands now."""
    readme = (ROOT / "README.md").read_text()
    recorded = set(re.findall(r"\d+(?:\.\d+)?", (ROOT / "bench" / "RESULTS.md").read_text().replace(",", "")))
    start = readme.index(header)
    rows = readme[start : readme.index("\n\n", start)].splitlines()[2:]
    quoted = [(figure, row.split("|")[1].strip()) for row in rows for cell in row.split("|")[2:4]
              for figure in re.findall(r"(?<![\w.:-])(\d{1,3}(?:,\d{3})+)(?![\w:])", cell)]
    assert len(quoted) > least, f"the README's table {header!r} was not found whole"
    missing = [(figure, row) for figure, row in quoted if figure.replace(",", "") not in recorded]
    assert not missing, f"figures the README quotes that bench/RESULTS.md does not hold: {missing}"


def test_the_nemesis_checker_reads_every_childs_store(tmp_path: Path) -> None:
    """Under `--processes` each child keeps its own store (`rdq-0.db`, …): the checker's "nothing left open" must
    read them all, or it would pass by reading nothing."""
    import sqlite3

    from bench.nemesis import Run, open_tasks, stores

    run = Run(1, 1.0, tmp_path, "unused", processes=2)
    for i in range(3):
        (tmp_path / f"n{i}").mkdir()
        for child, status in enumerate(("SUCCEEDED", "PENDING" if i == 2 else "DEAD")):
            with sqlite3.connect(tmp_path / f"n{i}" / f"rdq-{child}.db") as conn:
                conn.execute("CREATE TABLE tasks (status TEXT)")
                conn.execute("INSERT INTO tasks VALUES (?)", (status,))
    assert [len(stores(run, i)) for i in range(3)] == [2, 2, 2]
    assert open_tasks(run) == 1  # n2's second child's PENDING task


def test_a_runs_rate_is_taken_between_looks_that_both_saw_the_count_rise() -> None:
    """The look that counted n came up to a poll after the n-th record: the rate is taken up to the last look that
    counted fewer (else a 250 ms poll would read a 3 s steady phase up to 8 % slow)."""
    from bench.bench_processes import _steady_rate

    began = 0.0
    # 1,000 records/s from t=1 s: 500 at 1.5 s, 2,900 at 3.9 s; n = 3,000 was seen by a look at 4.2 s.
    assert _steady_rate((1.5, 500.0), (3.9, 2900.0), (4.2, 3000.0), began) == pytest.approx(1000.0)
    # Only one look before n: from it to the look that saw n.
    assert _steady_rate((1.5, 500.0), (1.5, 500.0), (4.0, 3000.0), began) == pytest.approx(1000.0)
    # The first look saw all n (a tiny run): the wall rate.
    assert _steady_rate((2.0, 3000.0), None, (2.0, 3000.0), began) == pytest.approx(1500.0)
