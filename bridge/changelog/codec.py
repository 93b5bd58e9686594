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
from dataclasses import dataclass
from typing import Any

import orjson  # several times faster than json at both ends: restore speed is a partition's downtime

from bridge.store.history import pack

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
_OUTCOMES = frozenset({"SUCCESS", "RETRYABLE_FAILURE", "PERMANENT_FAILURE", "LEASE_EXPIRED"})
_ATTEMPT_INTS = ("seq", "attempt_no", "redrive_no", "started_at", "finished_at")  # NOT NULL in the attempts table
_NUL = b"\\u0000"  # how orjson writes a NUL character in a string
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
    attempts: list[dict[str, Any]]  # as the record holds them (one written before notes has none)
    # The same as one JSON value, packed (bridge/store/history.py): the store keeps a restored history so
    # (restored_attempts). None where one holds a NUL character (SQLite 3.40's JSON functions cut a string short
    # at one): then restored as rows, with task_id.
    history: bytes | None
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
        _check_attempts(attempts)
        for entry in redrives:
            if not entry.keys() >= _REDRIVE_KEYS:
                raise Unreadable(f"a redrive lacks {sorted(_REDRIVE_KEYS - entry.keys())}")
            entry["task_id"] = task["id"]
        history = orjson.dumps(attempts)
        if _NUL in history:  # SQLite's JSON functions end a string at a NUL: this history is restored as rows
            for entry in attempts:
                entry["task_id"] = task["id"]
                entry.setdefault("note", None)
            return Restored(task, attempts, None, redrives, version)
        return Restored(task, attempts, pack(history), redrives, version)
    except Unreadable:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as e:  # json, base64, int(), fields
        raise Unreadable(f"{type(e).__name__}: {e}") from e


def _check_attempts(attempts: Any) -> None:
    """The attempts table's rules, checked here: a restored history is kept as one value (restored_attempts), not
    as rows its key and checks would refuse, and is read back as rows in `seq` order."""
    if not isinstance(attempts, list):
        raise Unreadable("attempts is not a list")
    before = None
    for entry in attempts:
        if not isinstance(entry, dict):
            raise Unreadable("an attempt is not an object")
        if not entry.keys() >= _ATTEMPT_KEYS:
            raise Unreadable(f"an attempt lacks {sorted(_ATTEMPT_KEYS - entry.keys())}")
        if entry["outcome"] not in _OUTCOMES:
            raise Unreadable(f"unknown attempt outcome {str(entry['outcome'])[:40]!r}")
        for name in _ATTEMPT_INTS:
            if type(entry[name]) is not int:  # a bool is not one either
                raise Unreadable(f"an attempt's {name} is not an integer")
        if before is not None and entry["seq"] <= before:
            raise Unreadable(f"attempt seq {entry['seq']} does not follow {before}")
        before = entry["seq"]


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
