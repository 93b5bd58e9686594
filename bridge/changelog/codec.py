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
import sqlite3
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import msgspec
import orjson  # several times faster than json at both ends: restore speed is a partition's downtime

from bridge.store.history import pack

SCHEMA = "rdq.task/v1"
SCHEMA_ORDERED = "rdq.task/v2"
READABLE = frozenset({SCHEMA, SCHEMA_ORDERED})

Scalar = str | int | float | None  # a column's value: a nested object or array in one is not a state


class _Attempt(msgspec.Struct):
    """An attempt as the attempts table keeps it: its NOT NULL integers strict (a bool, a float or a digit string
    is not one), its outcome one the store knows."""

    seq: int
    attempt_no: int
    redrive_no: int
    started_at: int
    finished_at: int
    outcome: Literal["SUCCESS", "RETRYABLE_FAILURE", "PERMANENT_FAILURE", "LEASE_EXPIRED"]
    error_type: Scalar
    error_message: Scalar
    error_stack: Scalar
    worker: Scalar
    late_result_of: Scalar
    note: Scalar = None  # records written before notes existed have none


class _Task(msgspec.Struct):
    id: str
    queue: str
    handler_ref: str
    status: Literal["PENDING", "IN_FLIGHT", "SUCCEEDED", "DEAD", "PARKED"]
    attempt_count: int
    redrive_count: int
    lease_token: int
    created_at: int
    life_started_at: int
    payload: bytes  # base64, strict (standard alphabet, padded, nothing after it)
    headers: dict[str, Any] | None = None
    handler_version: Scalar = None
    payload_content_type: Scalar = None
    next_attempt_at: int | None = None
    lease_expires_at: int | None = None
    lease_owner: Scalar = None
    lease_started_at: Scalar = None
    finished_at: int | None = None
    fetched_at: int | None = None
    dead_reason_type: Scalar = None
    dead_reason_message: Scalar = None
    dlq_state: Literal["PENDING", "PUBLISHED"] | None = None
    dlq_topic: Scalar = None
    dlq_partition: Scalar = None
    dlq_offset: Scalar = None
    home_topic: Scalar = None
    home_partition: int | None = None
    order_key: Scalar = None  # ordering: key (SPEC §12); records from before it have none
    order_seq: int | None = None
    order_hold: Scalar = None


class _Record(msgspec.Struct):
    schema: str
    version: int
    task: _Task
    attempts: list[_Attempt]
    redrives: list[dict[str, Any]]


# What `encode` writes of a task and an attempt: the fields `decode` reads, one list (headers and payload are
# written apart: headers parsed from the store's JSON text, the payload base64).
_TASK_FIELDS = tuple(name for name in _Task.__struct_fields__ if name not in ("headers", "payload"))
_ATTEMPT_FIELDS = _Attempt.__struct_fields__
_REDRIVE_FIELDS = ("redrive_no", "at", "by", "request_id", "key_id")
_REDRIVE_KEYS = frozenset(_REDRIVE_FIELDS)
_NUL = b"\\u0000"  # how msgspec (and orjson) write a NUL character in a string


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


# msgspec decodes a record into these types and checks them in one pass, in C: 16.8-17.8 us a record of five
# attempts against 24.3-25.4 for orjson's dicts and the checks in Python (`bench_changelog decode`).
_RECORD = msgspec.json.Decoder(_Record)
_HISTORY = msgspec.json.Encoder()


@dataclass(frozen=True)
class Restored:
    """A decoded record, as the store's restore statements take it."""

    task: dict[str, Any]
    attempts: list[_Attempt]
    # The same as one JSON value (written again from the decoded attempts: what the checks passed is what is kept,
    # a duplicate key or a foreign spelling gone), packed (bridge/store/history.py): the store keeps a restored
    # history so (restored_attempts). None where one holds a NUL character (SQLite 3.40's JSON functions cut a
    # string short at one): then restored as rows, with task_id.
    history: bytes | None
    redrives: list[dict[str, Any]]
    version: int


class Checked(NamedTuple):
    """A record parsed and checked, with what the store keeps beside its fields: the headers as JSON text, the
    content type (a default where none), the source reference, the history packed (None: see Restored.history)."""

    record: _Record
    headers: str
    content_type: Scalar
    source_ref: str | None
    history: bytes | None


def check(key: bytes | None, value: bytes) -> Checked:
    """Parse and check a record (`Unreadable` when it cannot be read); the restore builds its rows from this."""
    try:
        record = _RECORD.decode(value)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise Unreadable(_why_not(value, e)) from e
    if record.schema not in READABLE:
        raise Unreadable(_unknown_schema(record.schema))
    body = record.task
    if not body.handler_ref:
        raise Unreadable("the task has no handler_ref")
    if key is not None and key.decode("utf-8", "replace") != body.id:
        raise Unreadable(f"the record key {key[:80]!r} is not the task id {body.id[:80]!r}")
    _check_state(body)
    _check_attempts(record.attempts)
    headers = body.headers or {}
    source = headers.get("rdq.source")
    source_ref = None if source is None else f"{source}@{headers.get('rdq.kafka.timestamp', '')}"
    for entry in record.redrives:
        if not entry.keys() >= _REDRIVE_KEYS:
            raise Unreadable(f"a redrive lacks {sorted(_REDRIVE_KEYS - entry.keys())}")
        entry["task_id"] = body.id
    history = _HISTORY.encode(record.attempts)
    # SQLite's JSON functions end a string at a NUL: such a history is restored as rows.
    return Checked(record, orjson.dumps({k: str(v) for k, v in headers.items()}).decode(),
                   body.payload_content_type or "application/octet-stream", source_ref,
                   None if _NUL in history else pack(history))


def decode(key: bytes | None, value: bytes) -> Restored:
    checked = check(key, value)
    record = checked.record
    task = msgspec.structs.asdict(record.task)
    task.update(headers=checked.headers, payload_content_type=checked.content_type, source_ref=checked.source_ref)
    return Restored(task, record.attempts, checked.history, record.redrives, record.version)


def _why_not(value: bytes, error: Exception) -> str:
    """Why a record is unreadable: first whether its schema is one this bridge knows (a newer release's record
    may have any shape), then what its decoding found."""
    try:
        record = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        return f"not JSON: {e}"
    schema = record.get("schema") if isinstance(record, dict) else None
    if schema not in READABLE:
        return _unknown_schema(schema)
    return f"{type(error).__name__}: {_bounded(str(error))}"


def _bounded(message: str, most: int = 200) -> str:
    """msgspec's message quotes the value it refused whole (a status of a megabyte would be logged and kept so):
    cut to `most` characters, keeping where it was (" - at `$.task.status`")."""
    if len(message) <= most:
        return message
    at = message.rfind(" - at `")
    where = message[at:] if at >= 0 else ""
    return message[: max(most - len(where), 40)] + "…" + where


def _unknown_schema(schema: object) -> str:
    return f"unknown schema {repr(schema)[:40]} (this bridge reads {', '.join(sorted(READABLE))})"


def _check_attempts(attempts: list[_Attempt]) -> None:
    """The attempts table's key, checked here: a restored history is kept as one value (restored_attempts), not as
    rows its key would refuse, and is read back as rows in `seq` order. (Its types the decoding checked.)"""
    before = None
    for entry in attempts:
        if before is not None and entry.seq <= before:
            raise Unreadable(f"attempt seq {entry.seq} does not follow {before}")
        before = entry.seq


def _check_state(task: _Task) -> None:
    """The store's own rules on a state, checked before it is written: a record that breaks one would fail its
    whole restore batch (and the partition would retry for ever, unready). (Types and the status sets the decoding
    checked; v1 records written by the release that brought ordering carry PARKED too: one status set for both.)"""
    if (task.status == "IN_FLIGHT") != (task.lease_expires_at is not None):
        raise Unreadable("a lease must be set exactly while IN_FLIGHT")
    if (task.status in ("SUCCEEDED", "DEAD", "PARKED")) != (task.next_attempt_at is None):
        raise Unreadable(f"next_attempt_at must be set exactly while PENDING or IN_FLIGHT (status {task.status})")
    if task.status == "PARKED" and not isinstance(task.order_key, str):
        raise Unreadable("a PARKED task needs an order_key")
