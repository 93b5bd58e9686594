"""The changelog record (SPEC §10): key = task id, value = the task with its attempts and redrives.

`{"schema": "rdq.task/v1", "version": n, "task": {...}, "attempts": [...], "redrives": [...]}`; times are integer
milliseconds since the Unix epoch (restore speed: no date parsing), the payload is base64. `version` counts the
task's durable transitions. A purged task's record is a tombstone (no value).

The schema is versioned by meaning: a record whose reader must know something an earlier release did not is
written under a new schema, so a bridge rolled back reads what it can and quarantines the rest (never reads a
state it does not understand as one it does). `rdq.task/v2`: a task of a queue with `ordering: key` (the PARKED
status, `order_key`/`order_seq`/`order_hold`); every other task is still written as `rdq.task/v1`.
"""

from __future__ import annotations

import base64
import binascii
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

import orjson  # several times faster than json at both ends: restore speed is a partition's downtime

SCHEMA = "rdq.task/v1"
SCHEMA_ORDERED = "rdq.task/v2"
READABLE = frozenset({SCHEMA, SCHEMA_ORDERED})
_STATUSES = frozenset({"PENDING", "IN_FLIGHT", "SUCCEEDED", "DEAD", "PARKED"})
_DLQ_STATES = frozenset({None, "PENDING", "PUBLISHED"})

_TASK_FIELDS = (
    "id", "queue", "handler_ref", "handler_version", "payload_content_type", "status", "attempt_count",
    "redrive_count", "next_attempt_at", "lease_expires_at", "lease_token", "lease_owner", "lease_started_at",
    "created_at", "life_started_at", "finished_at", "fetched_at", "dead_reason_type", "dead_reason_message",
    "dlq_state", "dlq_topic", "dlq_partition", "dlq_offset", "home_topic", "home_partition",
    "order_key", "order_seq", "order_hold",  # ordering: key (SPEC §12); records from before it have none
)  # fmt: skip
_ATTEMPT_FIELDS = ("seq", "attempt_no", "redrive_no", "started_at", "finished_at", "outcome", "error_type",
                   "error_message", "error_stack", "worker", "late_result_of", "note")
_REDRIVE_FIELDS = ("redrive_no", "at", "by", "request_id", "key_id")
_ATTEMPT_KEYS = frozenset(_ATTEMPT_FIELDS) - {"note"}  # records written before notes existed have none
_REDRIVE_KEYS = frozenset(_REDRIVE_FIELDS)
_INTS = {"attempt_count", "redrive_count", "lease_token", "created_at", "life_started_at"}


class Unreadable(ValueError):
    """A changelog record this bridge cannot read: corrupt, or written by a newer bridge."""


def encode(task: sqlite3.Row | dict[str, Any], attempts: list[Any], redrives: list[Any],
           version: int, overrides: dict[str, Any] | None = None) -> bytes:
    body = {name: task[name] for name in _TASK_FIELDS}
    body["headers"] = orjson.loads(task["headers"])
    body["payload"] = base64.b64encode(bytes(task["payload"])).decode("ascii")
    if overrides:
        body.update(overrides)
    record = {
        "schema": SCHEMA_ORDERED if body.get("order_key") is not None else SCHEMA,
        "version": version,
        "task": body,
        "attempts": [{name: a[name] for name in _ATTEMPT_FIELDS} for a in attempts],
        "redrives": [{name: r[name] for name in _REDRIVE_FIELDS} for r in redrives],
    }
    return orjson.dumps(record)


_PAYLOAD_AT = b'"task":{"payload":"'  # how a record the store built begins its task (queries.sql)


def with_payload(record: bytes, payload: bytes) -> bytes:
    """A record SQLite built (`changelog_outbox_records`) with its payload, base64, spliced in: the store leaves it
    "" as the first field of the task. Before it only the schema and version, no content of the task, so the
    first match is the place."""
    at = record.index(_PAYLOAD_AT) + len(_PAYLOAD_AT)
    return b"".join((record[:at], base64.b64encode(payload), record[at:]))


@dataclass(frozen=True)
class Restored:
    """A decoded record, as the store's restore statements take it."""

    task: dict[str, Any]
    attempts: list[dict[str, Any]]
    redrives: list[dict[str, Any]]
    version: int


def decode(key: bytes | None, value: bytes) -> Restored:
    try:
        record = orjson.loads(value)
        schema = record.get("schema") if isinstance(record, dict) else None
        if schema not in READABLE:
            raise Unreadable(f"unknown schema {schema!r} (this bridge reads {', '.join(sorted(READABLE))})")
        body = record["task"]
        version = int(record["version"])
        task = {name: body.get(name) for name in _TASK_FIELDS}
        for name in _INTS:
            task[name] = int(body[name])
        if not isinstance(task["id"], str) or not isinstance(task["queue"], str) or not task["handler_ref"]:
            raise Unreadable("the task has no id, queue or handler_ref")
        if key is not None and key.decode("utf-8", "replace") != task["id"]:
            raise Unreadable(f"the record key {key!r} is not the task id {task['id']!r}")
        _check_state(task)
        headers = body.get("headers") or {}
        if not isinstance(headers, dict):
            raise Unreadable("headers is not an object")
        task["headers"] = orjson.dumps({str(k): str(v) for k, v in headers.items()}).decode()
        task["payload"] = base64.b64decode(body["payload"], validate=True)
        task["payload_content_type"] = task["payload_content_type"] or "application/octet-stream"
        source = headers.get("rdq.source")
        task["source_ref"] = None if source is None else f"{source}@{headers.get('rdq.kafka.timestamp', '')}"
        attempts, redrives = record["attempts"], record["redrives"]
        for entry, fields in [*((a, _ATTEMPT_KEYS) for a in attempts), *((r, _REDRIVE_KEYS) for r in redrives)]:
            if not fields <= entry.keys():
                raise Unreadable(f"an attempt or redrive lacks {sorted(fields - entry.keys())}")
            entry["task_id"] = task["id"]
            if fields is _ATTEMPT_KEYS:
                entry.setdefault("note", None)
        return Restored(task, attempts, redrives, version)
    except Unreadable:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as e:  # json, base64, int(), fields
        raise Unreadable(f"{type(e).__name__}: {e}") from e


def _check_state(task: dict[str, Any]) -> None:
    """The store's own rules on a state, checked before it is written: a record that breaks one would fail its
    whole restore batch (and the partition would retry for ever, unready)."""
    # v1 records written by the release that brought ordering carry PARKED too: one status set for both.
    if task["status"] not in _STATUSES:
        raise Unreadable(f"unknown status {str(task['status'])[:40]!r}")
    if task["dlq_state"] not in _DLQ_STATES:
        raise Unreadable(f"unknown dlq_state {str(task['dlq_state'])[:40]!r}")
    if (task["status"] == "IN_FLIGHT") != (task["lease_expires_at"] is not None):
        raise Unreadable("a lease must be set exactly while IN_FLIGHT")
    if (task["status"] in ("SUCCEEDED", "DEAD", "PARKED")) != (task["next_attempt_at"] is None):
        raise Unreadable(f"next_attempt_at must be set exactly while PENDING or IN_FLIGHT (status {task['status']})")
    if task["status"] == "PARKED" and not isinstance(task["order_key"], str):
        raise Unreadable("a PARKED task needs an order_key")
    for name in ("next_attempt_at", "lease_expires_at", "finished_at", "fetched_at", "order_seq", "home_partition"):
        if task[name] is not None and (not isinstance(task[name], int) or isinstance(task[name], bool)):
            raise Unreadable(f"{name} is not an integer")


def _task_id_of(key: bytes | None) -> str | None:
    """The task an unreadable record is of: its record key (the task id; compaction keeps a key's last record)."""
    if not key:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass
class Picked:
    """A batch of changelog records reduced to each task's last word (`pick_last`), decoded off the store's thread.

    `last`: each task's state (None: a tombstone); `held`: tasks whose last record cannot be read (offset, why;
    quarantined); `raw`: each readable last record as read; `unreadable`: every unreadable record (offset, key,
    value, why), kept in changelog_unreadable."""

    last: dict[str, Restored | None]
    held: dict[str, tuple[int, str]]
    raw: dict[str, tuple[int, bytes | None, bytes]]
    unreadable: list[tuple[int, bytes | None, bytes, str]]
    applied: int = 0
    tombstones: int = 0


def pick_last(records: list[tuple[int, bytes | None, bytes | None]], yield_every: int = 0) -> Picked:
    """Each task's last record of the batch, in log order (pure: no store). A later record holds a task's whole
    state, so only the last counts.

    `yield_every`: give the GIL up every that many records. The restore decodes on its own thread while the store's
    thread applies the batch before: that thread gives the GIL up in every SQLite step and, to take it back from a
    thread that does not give it up, waits a switch interval (5 ms) each time; measured, it applied 3x slower."""
    picked = Picked({}, {}, {}, [])
    last, held = picked.last, picked.held
    for n, (offset, key, value) in enumerate(records, start=1):
        if yield_every and n % yield_every == 0:
            time.sleep(0)
        if value is None:
            task_id = (key or b"").decode("utf-8", "replace")
            last.pop(task_id, None)  # re-inserted at the end: the tombstone is its last word
            last[task_id] = None
            held.pop(task_id, None)
            picked.tombstones += 1
            continue
        try:
            restored = decode(key, value)
        except Unreadable as e:
            picked.unreadable.append((offset, key, value, str(e)))
            owner = _task_id_of(key)
            if owner is not None:
                last.pop(owner, None)
                held[owner] = (offset, str(e))
            continue
        task_id = restored.task["id"]
        last.pop(task_id, None)
        last[task_id] = restored
        held.pop(task_id, None)
        picked.raw[task_id] = (offset, key, value)
        picked.applied += 1
    return picked
