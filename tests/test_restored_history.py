"""A restored history kept as one value (SPEC §10, migration 0013): every reader sees it as the rows it was.

The restore writes a changelog record's attempts array as one row (restored_attempts); the attempts made after
are rows of `attempts`; readers read the view attempt_history. These tests restore real records into a real
SQLite file and then use the task the way the bridge does: run it again, log it, dead-letter it, purge it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

from bridge.changelog.local import HomeState
from bridge.model import ErrorInfo, Outcome, Status
from bridge.store.history import with_history_functions
from bridge.store.queries import migrations, queries
from bridge.store.reader import StoreReader
from bridge.store.tasks import Store
from tests.helpers import T0, query_plan, report
from tests.test_changelog_store import HOME, on, scoped_store


async def _count(store: Store, sql: str) -> int:
    return int(await store.db.read(lambda c: c.execute(sql).fetchone()[0]))


async def _logged_with_history(tmp_path: Path, retries: list[str],
                               offset: int = 1) -> tuple[str, dict[str, Any], list[Any]]:
    """A task failed once on first delivery and then once for each message in `retries`, logged: its id, its
    changelog record and its attempts as the store that made them reads them."""
    store, local = await scoped_store(tmp_path)
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        task = on("src", 0, offset)
        await store.submit(task)
        for i, message in enumerate(retries):
            [claimed] = await store.claim_due("q", 1, 30, "w", T0 + 10 * i)
            error = ErrorInfo("builtins.RuntimeError", message, "Traceback ...")
            await store.record_retry(task.id, claimed.lease_token, report(Outcome.RETRYABLE_FAILURE, T0 + 10 * i,
                                                                          error), T0 + 10 * i + 5)
        [entry] = await local.outbox(10)
        made = await store.get(task.id)
        assert made is not None and len(made.attempts) == len(retries) + 1
        return task.id, json.loads(entry.value or b""), list(made.attempts)
    finally:
        await store.close()


async def _restore(tmp_path: Path, records: dict[str, dict[str, Any]]) -> tuple[Store, Any]:
    store, local = await scoped_store(tmp_path)
    batch = [(i, task_id.encode(), json.dumps(record).encode()) for i, (task_id, record) in enumerate(records.items())]
    errors: list[str] = []
    result = await local.restore_batch(HOME, "cl", batch, T0, errors)
    assert (result.applied, result.unreadable, errors) == (len(records), 0, [])
    return store, local


async def test_a_restored_history_reads_as_the_attempts_it_was_and_grows_in_order(tmp_path: Path) -> None:
    """Kept as one value, read as rows: the restored task's attempts are the original ones; the next attempt
    continues its numbering (not seq 1 again beside the restored seq 1); the next changelog record and the DLQ
    envelope's attempts hold all of them, in order."""
    task_id, record, made = await _logged_with_history(tmp_path / "a", ["refused", "timed out"])
    store, local = await _restore(tmp_path / "b", {task_id: record})
    try:
        assert await _count(store, "SELECT COUNT(*) FROM restored_attempts") == 1
        assert await _count(store, "SELECT COUNT(*) FROM attempts") == 0  # one value, no rows
        restored = await store.get(task_id)
        assert restored is not None and list(restored.attempts) == made
        await local.set_home(HOME, HomeState.ACTIVE)
        [claimed] = await store.claim_due("q", 1, 30, "w", T0 + 100)
        dead = ErrorInfo("builtins.ValueError", "bad input")
        await store.record_dead(task_id, claimed.lease_token, report(Outcome.PERMANENT_FAILURE, T0 + 100, dead), dead)
        now = await store.get(task_id)
        assert now is not None and now.status == Status.DEAD
        assert [a.attempt_no for a in now.attempts] == [1, 2, 3, 4] and list(now.attempts[:3]) == made
        [entry] = await local.outbox(10)
        logged = json.loads(entry.value or b"")["attempts"]
        assert [a["seq"] for a in logged] == [1, 2, 3, 4]
        assert [a["error_message"] for a in logged] == ["first delivery failed", "refused", "timed out", "bad input"]
        [dlq] = await store.dlq_outbox_entries(10)
        assert [json.loads(body)["error"]["message"] for body in dlq.attempts_json] == [
            "first delivery failed", "refused", "timed out", "bad input"]
    finally:
        await store.close()


async def test_older_records_and_nul_characters_restore_whole(tmp_path: Path) -> None:
    """A record written before notes existed has attempts without one: read as none. An error message holding a
    NUL character (SQLite's JSON functions end a string at one) is restored as rows, whole."""
    old_id, old, old_made = await _logged_with_history(tmp_path / "a", ["refused"])
    for attempt in old["attempts"]:
        del attempt["note"]
    nul_id, nul, nul_made = await _logged_with_history(tmp_path / "b", ["half\x00of it"], offset=2)
    store, _ = await _restore(tmp_path / "c", {old_id: old, nul_id: nul})
    try:
        restored_old, restored_nul = await store.get(old_id), await store.get(nul_id)
        assert restored_old is not None and list(restored_old.attempts) == old_made
        assert [a.note for a in restored_old.attempts] == [None, None]
        assert restored_nul is not None and list(restored_nul.attempts) == nul_made
        assert restored_nul.attempts[1].error is not None and restored_nul.attempts[1].error.message == "half\x00of it"
        assert await _count(store, "SELECT COUNT(*) FROM restored_attempts") == 1  # the older one
        assert await _count(store, "SELECT COUNT(*) FROM attempts") == 2  # the one with a NUL, as rows
    finally:
        await store.close()


async def test_a_restored_history_goes_with_its_task(tmp_path: Path) -> None:
    """Purged, or its partition handed over: the value goes too (no history left behind for an id)."""
    task_id, record, _ = await _logged_with_history(tmp_path / "a", ["refused"])
    other_id, other, _ = await _logged_with_history(tmp_path / "b", ["refused"], offset=2)
    store, local = await _restore(tmp_path / "c", {task_id: record, other_id: other})
    try:
        await local.set_home(HOME, HomeState.ACTIVE)
        claimed = {t.id: t for t in await store.claim_due("q", 10, 30, "w", T0 + 100)}
        await store.record_success(task_id, claimed[task_id].lease_token, 3, report(Outcome.SUCCESS, T0 + 100))
        assert await store.purge("q", "finished", T0 + 10**9) == 1
        assert await _count(store, "SELECT COUNT(*) FROM restored_attempts") == 1
        assert await local.drop_home(HOME) == 1
        assert await _count(store, "SELECT COUNT(*) FROM restored_attempts") == 0
        assert await _count(store, "SELECT COUNT(*) FROM attempt_history") == 0
    finally:
        await store.close()


async def test_no_query_reads_every_attempt_to_find_a_tasks(tmp_path: Path) -> None:
    """Every named query that reads attempts finds them by their task (SQLite 3.40 folds a filter into a UNION
    ALL view only where it compares with a parameter: a correlated or IN filter scanned both tables whole, which
    a test on a handful of rows never notices)."""
    await (await Store.open(tmp_path / "rdq.db")).close()
    conn = with_history_functions(sqlite3.connect(tmp_path / "rdq.db"))  # as the bridge's connections are
    reading = re.compile(r"\b(FROM|JOIN)\s+(attempts|restored_attempts|restored_attempt_rows|attempt_history)\b")
    readers = {name: sql for name, sql in queries().items() if reading.search(sql)}
    assert {"get_attempts", "attempts_of_many", "attempts_json_of_many", "changelog_outbox_records",
            "lost_a_lease", "insert_attempt", "insert_first_attempts"} <= readers.keys()
    for name, sql in readers.items():
        whole = [step for step in query_plan(conn, sql)  # a table read whole, or an index built for one query
                 if re.match(r"SCAN (attempts|restored_attempts|restored)\b", step) or "AUTOMATIC" in step]
        assert not whole, (name, whole)
    conn.close()


async def test_a_restored_history_is_stored_packed_and_every_connection_reads_it_whole(tmp_path: Path) -> None:
    """Packed on disk (migration 0015: writing the value was most of a restore's store time), read back whole by
    the writer's connection, the scans' read-only one and `rdq store` (StoreReader), which each give SQLite the
    function the view unpacks it with."""
    stack = "Traceback (most recent call last):\n" + '  File "app.py", line 12, in handle\n' * 40
    task_id, record, made = await _logged_with_history(tmp_path / "a", ["refused", "refused", "refused"])
    for attempt in record["attempts"]:
        attempt["error_stack"] = stack
    made = [dataclasses.replace(a, error=dataclasses.replace(a.error, stack=stack)) if a.error else a
            for a in made]
    store, _ = await _restore(tmp_path / "b", {task_id: record})
    try:
        kind, size = await store.db.read(
            lambda c: c.execute("SELECT typeof(attempts), length(attempts) FROM restored_attempts").fetchone())
        assert kind == "blob" and size < len(json.dumps(record["attempts"])) / 5
        restored = await store.get(task_id)
        assert restored is not None and list(restored.attempts) == made
        scanned = await store.db.scan(lambda c: c.execute(
            "SELECT error_stack FROM attempt_history WHERE task_id = ? ORDER BY seq", (task_id,)).fetchall())
        assert [row[0] for row in scanned] == [a.error.stack if a.error else None for a in made]
    finally:
        await store.close()
    reader = StoreReader(tmp_path / "b" / "rdq.db")
    try:
        offline = reader.get(task_id)
        assert offline is not None and list(offline.attempts) == made
    finally:
        reader.close()


async def test_a_history_restored_as_text_before_version_15_reads_as_it_was(tmp_path: Path) -> None:
    """A store restored by an earlier release holds its histories as JSON text under the views of version 13:
    migrated to 15, each reads as it was, not rewritten."""
    task_id, record, made = await _logged_with_history(tmp_path / "a", ["refused"])
    store, _ = await _restore(tmp_path / "b", {task_id: record})
    await store.close()
    v13_views = re.findall(r"CREATE VIEW .*?;", migrations()[12][2], re.S)
    conn = with_history_functions(sqlite3.connect(tmp_path / "b" / "rdq.db", isolation_level=None))
    conn.executescript("BEGIN; UPDATE restored_attempts SET attempts = rdq_history(attempts);"
                       "DROP VIEW attempt_history; DROP VIEW restored_attempt_rows;"
                       f"{' '.join(v13_views)} PRAGMA user_version = 14; COMMIT;")
    assert conn.execute("SELECT typeof(attempts) FROM restored_attempts").fetchone()[0] == "text"
    conn.close()
    store = await Store.open(tmp_path / "b" / "rdq.db", scoped=True)
    try:
        assert await _count(store, "PRAGMA user_version") == len(migrations())
        assert await _count(store, "SELECT COUNT(*) FROM restored_attempts WHERE typeof(attempts) = 'text'") == 1
        restored = await store.get(task_id)
        assert restored is not None and list(restored.attempts) == made
    finally:
        await store.close()
