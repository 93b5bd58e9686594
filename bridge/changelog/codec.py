"""The changelog record (SPEC §10): key = task id, value = the task with its attempts and redrives.

`{"schema": "rdq.task/v1", "version": n, "task": {...}, "attempts": [...], "redrives": [...]}`; times are integer
milliseconds since the Unix epoch (restore speed: no date parsing), the payload is base64. `version` counts the
task's durable transitions. A purged task's record is a tombstone (no value).
"""

from __future__ import annotations

import base64
import binascii
import sqlite3
from dataclasses import dataclass
from typing import Any

import orjson  # several times faster than json at both ends: restore speed is a partition's downtime

SCHEMA = "rdq.task/v1"

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
        "schema": SCHEMA,
        "version": version,
        "task": body,
        "attempts": [{name: a[name] for name in _ATTEMPT_FIELDS} for a in attempts],
        "redrives": [{name: r[name] for name in _REDRIVE_FIELDS} for r in redrives],
    }
    return orjson.dumps(record)


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
        if schema != SCHEMA:
            raise Unreadable(f"unknown schema {schema!r} (this bridge reads {SCHEMA})")
        body = record["task"]
        version = int(record["version"])
        task = {name: body.get(name) for name in _TASK_FIELDS}
        for name in _INTS:
            task[name] = int(body[name])
        if not isinstance(task["id"], str) or not isinstance(task["queue"], str) or not task["handler_ref"]:
            raise Unreadable("the task has no id, queue or handler_ref")
        if key is not None and key.decode("utf-8", "replace") != task["id"]:
            raise Unreadable(f"the record key {key!r} is not the task id {task['id']!r}")
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
