"""The task and its attempts (SPEC §3). Times are integer milliseconds since the Unix epoch, UTC."""

from __future__ import annotations

import base64
import json
import random
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from bridge.clock import parse_rfc3339, rfc3339

# A row of the store: sqlite3.Row, or a plain dict (faster to read by name, `store.dict_rows`).
Row = sqlite3.Row | Mapping[str, Any]

# Error types the bridge itself declares (distinct so an operator can tell them apart at 3am).
UNROUTABLE = "rdq.Unroutable"
VERSION_MISMATCH = "rdq.HandlerVersionMismatch"
TIMEOUT = "rdq.Timeout"
LEASE_EXPIRED = "rdq.LeaseExpired"


class Status(StrEnum):
    PENDING = "PENDING"
    IN_FLIGHT = "IN_FLIGHT"
    SUCCEEDED = "SUCCEEDED"
    DEAD = "DEAD"
    PARKED = "PARKED"  # behind an open task of its key (ordering: key), not run, no attempt spent (SPEC §12)

    @property
    def terminal(self) -> bool:
        return self in (Status.SUCCEEDED, Status.DEAD)


class Outcome(StrEnum):
    SUCCESS = "SUCCESS"
    RETRYABLE_FAILURE = "RETRYABLE_FAILURE"
    PERMANENT_FAILURE = "PERMANENT_FAILURE"
    LEASE_EXPIRED = "LEASE_EXPIRED"


def home_of(headers: dict[str, str]) -> tuple[str, int] | None:
    """A task's home (SPEC §10): the (topic, partition) of its `rdq.source` = kafka://topic/partition/offset."""
    source = headers.get("rdq.source", "")
    if not source.startswith("kafka://"):
        return None
    parts = source[len("kafka://"):].rsplit("/", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def error_type_matches(stored: str | None, wanted: str) -> bool:
    """An error-type filter: the type as stored (`handlers.examples.TransientError`) or, for a name without a
    module, the class name alone (`TransientError`) — as the config's `errors` lists take it."""
    if stored is None:
        return False
    return stored == wanted or ("." not in wanted and stored.endswith("." + wanted))


def home_params(home: tuple[str, int] | None) -> dict[str, Any]:
    return {"home_topic": home[0] if home else None, "home_partition": home[1] if home else None}


_CROCKFORD = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # a ULID's alphabet
_FIVE_BITS = bytes(_CROCKFORD[i & 31] for i in range(256))  # a random byte → a random character of it
_last_ms: tuple[int, str] = (-1, "")  # the last millisecond's ten characters (one tuple: swapped whole)


def new_task_id() -> str:
    """A ULID: the time in ms (ten characters), then 80 random bits (sixteen). Made here rather than by `ULID()`,
    whose generator takes a lock to be monotonic within a millisecond: with many handler threads making ids that
    lock convoys with the GIL; and written out by a table rather than python-ulid's base32 (3.1 → 0.4 µs an id,
    made for every failing record). Ids need to be unique and roughly time-ordered, not strictly monotonic."""
    global _last_ms
    now_ms = time.time_ns() // 1_000_000
    last = _last_ms
    if last[0] != now_ms:
        last = _last_ms = (now_ms, ulid_time(now_ms))
    return last[1] + random.randbytes(16).translate(_FIVE_BITS).decode()


def ulid_time(ms: int) -> str:
    """The ten characters of a ULID that say its millisecond (48 bits, two zero bits in front)."""
    return "".join(chr(_CROCKFORD[(ms >> shift) & 31]) for shift in range(45, -5, -5))


def headers_json(headers: Mapping[str, str]) -> str:
    """A task's headers as the store keeps them: compact JSON, by orjson (a tenth of `json.dumps`' time, paid by
    the store's writer thread for every new task); a text orjson refuses (a lone surrogate) by `json`."""
    try:
        return orjson.dumps(headers).decode()
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(headers, separators=(",", ":"))


def error_type_name(kind: type[BaseException]) -> str:
    """How an exception type is named in tasks, DLQ envelopes, metrics and `errors:` lists: `module.Class`
    (`ValueError` alone for a builtin). A class of the bridge that moved to another module keeps the name it had
    (its own `stable_name`), so stored tasks, filters and users' configs go on matching it."""
    stable = vars(kind).get("stable_name")
    if isinstance(stable, str):
        return stable
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


@dataclass(frozen=True)
class ErrorInfo:
    type: str
    message: str = ""
    stack: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "stack": self.stack}

    @classmethod
    def from_exception(cls, exc: BaseException, stack: str | None = None) -> ErrorInfo:
        return cls(error_type_name(type(exc)), str(exc), stack)


@dataclass(frozen=True)
class Attempt:
    attempt_no: int
    redrive_no: int
    started_at: int
    finished_at: int
    outcome: Outcome
    error: ErrorInfo | None = None
    worker: str | None = None
    late_result_of: int | None = None
    seq: int = 0
    note: str | None = None  # e.g. how long the task waited for its queue's circuit breaker before this attempt

    @classmethod
    def from_row(cls, row: Row) -> Attempt:
        error = None
        if row["error_type"] is not None:
            error = ErrorInfo(row["error_type"], row["error_message"] or "", row["error_stack"])
        return cls(
            attempt_no=row["attempt_no"], redrive_no=row["redrive_no"], started_at=row["started_at"],
            finished_at=row["finished_at"], outcome=Outcome(row["outcome"]), error=error, worker=row["worker"],
            late_result_of=row["late_result_of"], seq=row["seq"], note=row["note"],
        )  # fmt: skip

    def params(self, task_id: str) -> dict[str, Any]:
        return {
            "task_id": task_id, "attempt_no": self.attempt_no, "redrive_no": self.redrive_no,
            "started_at": self.started_at, "finished_at": self.finished_at, "outcome": self.outcome.value,
            "error_type": self.error.type if self.error else None,
            "error_message": self.error.message if self.error else None,
            "error_stack": self.error.stack if self.error else None,
            "worker": self.worker, "late_result_of": self.late_result_of, "note": self.note,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Attempt:
        error = data.get("error")
        return cls(
            attempt_no=int(data["attempt_no"]), redrive_no=int(data.get("redrive_no", 0)),
            started_at=parse_rfc3339(data["started_at"]) or 0, finished_at=parse_rfc3339(data["finished_at"]) or 0,
            outcome=Outcome(data["outcome"]),
            error=ErrorInfo(error["type"], error.get("message") or "", error.get("stack")) if error else None,
            worker=data.get("worker"), late_result_of=data.get("late_result_of"), note=data.get("note"),
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt_no": self.attempt_no,
            "redrive_no": self.redrive_no,
            "started_at": rfc3339(self.started_at),
            "finished_at": rfc3339(self.finished_at),
            "outcome": self.outcome.value,
            "error": self.error.to_json() if self.error else None,
            "worker": self.worker,
            **({"late_result_of": self.late_result_of} if self.late_result_of is not None else {}),
            **({"note": self.note} if self.note is not None else {}),
        }


@dataclass(frozen=True)
class Task:
    id: str
    queue: str
    handler_ref: str
    handler_version: str | None
    payload: bytes
    payload_content_type: str
    headers: dict[str, str]
    status: Status
    attempt_count: int
    redrive_count: int
    next_attempt_at: int | None
    lease_expires_at: int | None
    lease_token: int
    lease_owner: str | None
    lease_started_at: int | None
    created_at: int
    life_started_at: int
    finished_at: int | None
    fetched_at: int | None
    dead_reason: ErrorInfo | None
    dlq_state: str | None
    dlq_topic: str | None
    dlq_partition: int | None
    dlq_offset: int | None
    attempts: tuple[Attempt, ...] = field(default=())
    dlq_failures: int = 0  # failed DLQ publish tries since it went DEAD (the outbox's own retry count)
    # ordering: key (SPEC §12): the key's records of one partition, in offset order; order_hold: on_dead `hold`
    order_key: str | None = None
    order_seq: int | None = None
    order_hold: bool = False
    parked_behind: int = 0  # records of its key parked behind it, when read with that count (the DLQ outbox)
    lost_lease: bool = False  # its history has a lapsed lease (set by a claim with the changelog on)

    @property
    def source(self) -> str:
        return self.headers.get("rdq.source", "")

    @property
    def home(self) -> tuple[str, int] | None:
        return home_of(self.headers)

    @classmethod
    def from_row(cls, row: Row, attempts: tuple[Attempt, ...] = (), parked_behind: int = 0) -> Task:
        reason = None
        if row["dead_reason_type"] is not None:
            reason = ErrorInfo(row["dead_reason_type"], row["dead_reason_message"] or "")
        return cls(
            id=row["id"], queue=row["queue"], handler_ref=row["handler_ref"],
            handler_version=row["handler_version"], payload=bytes(row["payload"]),
            payload_content_type=row["payload_content_type"], headers=json.loads(row["headers"]),
            status=Status(row["status"]), attempt_count=row["attempt_count"], redrive_count=row["redrive_count"],
            next_attempt_at=row["next_attempt_at"], lease_expires_at=row["lease_expires_at"],
            lease_token=row["lease_token"], lease_owner=row["lease_owner"],
            lease_started_at=row["lease_started_at"], created_at=row["created_at"],
            life_started_at=row["life_started_at"], finished_at=row["finished_at"], fetched_at=row["fetched_at"],
            dead_reason=reason, dlq_state=row["dlq_state"], dlq_topic=row["dlq_topic"],
            dlq_partition=row["dlq_partition"], dlq_offset=row["dlq_offset"], attempts=attempts,
            dlq_failures=row["dlq_failures"], order_key=_column(row, "order_key"),
            order_seq=_column(row, "order_seq"), order_hold=bool(_column(row, "order_hold")),
            parked_behind=parked_behind,
        )  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any], attempts: tuple[Attempt, ...] = ()) -> Task:
        """The inverse of to_json: a task as a DLQ envelope carries it."""
        reason = data.get("dead_reason")
        dlq = data.get("dlq") or {}
        return cls(
            id=data["id"], queue=data["queue"], handler_ref=data["handler_ref"],
            handler_version=data.get("handler_version"), payload=base64.b64decode(data["payload"]),
            payload_content_type=data.get("payload_content_type") or "application/octet-stream",
            headers={str(k): str(v) for k, v in (data.get("headers") or {}).items()},
            status=Status(data["status"]), attempt_count=int(data["attempt_count"]),
            redrive_count=int(data.get("redrive_count", 0)), next_attempt_at=parse_rfc3339(data.get("next_attempt_at")),
            lease_expires_at=None, lease_token=0, lease_owner=None, lease_started_at=None,
            created_at=parse_rfc3339(data["created_at"]) or 0,
            life_started_at=parse_rfc3339(data.get("life_started_at") or data["created_at"]) or 0,
            finished_at=parse_rfc3339(data.get("finished_at")), fetched_at=parse_rfc3339(data.get("fetched_at")),
            dead_reason=ErrorInfo(reason["type"], reason.get("message") or "") if reason else None,
            dlq_state=dlq.get("state"), dlq_topic=dlq.get("topic"), dlq_partition=dlq.get("partition"),
            dlq_offset=dlq.get("offset"), attempts=attempts, **_ordering_from_json(data.get("ordering")),
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """Every SPEC §3 field, payload base64, times RFC 3339: the DLQ envelope's and the CLI's view."""
        return {
            "id": self.id,
            "queue": self.queue,
            "handler_ref": self.handler_ref,
            "handler_version": self.handler_version,
            "payload": base64.b64encode(self.payload).decode("ascii"),
            "payload_content_type": self.payload_content_type,
            "headers": dict(self.headers),
            "status": self.status.value,
            "attempt_count": self.attempt_count,
            "redrive_count": self.redrive_count,
            "next_attempt_at": rfc3339(self.next_attempt_at),
            "lease_expires_at": rfc3339(self.lease_expires_at),
            "created_at": rfc3339(self.created_at),
            "life_started_at": rfc3339(self.life_started_at),
            "finished_at": rfc3339(self.finished_at),
            "fetched_at": rfc3339(self.fetched_at),
            "dead_reason": self.dead_reason.to_json() if self.dead_reason else None,
            "dlq": {"state": self.dlq_state, "topic": self.dlq_topic, "partition": self.dlq_partition,
                    "offset": self.dlq_offset} if self.dlq_state else None,
            **({"ordering": {"key": self.order_key, "seq": self.order_seq, "hold": self.order_hold,
                             "parked_behind": self.parked_behind}}
               if self.order_key is not None else {}),
        }  # fmt: skip


def _column(row: Row, name: str) -> Any:
    """A column that rows read before its migration do not have (a store file of an older bridge, read by
    `rdq store`): found at once on a current store."""
    try:
        return row[name]
    except (KeyError, IndexError):
        return None


def _ordering_from_json(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict) or not data.get("key"):
        return {}
    return {"order_key": str(data["key"]), "order_seq": data.get("seq"), "order_hold": bool(data.get("hold"))}


def order_key_of(topic: str, partition: int, key: bytes | None) -> str | None:
    """The ordering key of a record (SPEC §12): its key within its partition; None for a record without a key
    (each is its own key: never parked)."""
    if key is None:
        return None
    return f"{topic}/{partition}/{base64.b64encode(key).decode('ascii')}"


def key_of_order_key(order_key: str) -> bytes:
    """The record key an ordering key was made of (order_key_of's inverse)."""
    return parse_order_key(order_key)[2]


def parse_order_key(order_key: str) -> tuple[str, int, bytes]:
    """(topic, partition, record key) of an ordering key. A topic name has no `/` and a partition is a number, so
    the key's base64 is everything after the second `/` (base64 itself holds `/` for about 30% of random 16-byte
    keys: never split from the right)."""
    parts = order_key.split("/", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        raise ValueError(f"not an ordering key: {order_key[:120]!r}")
    return parts[0], int(parts[1]), base64.b64decode(parts[2], validate=True)


@dataclass(frozen=True)
class NewTask:
    """A first-delivery failure to store: PENDING (retry due at next_attempt_at) or DEAD (dead-letter now)."""

    queue: str
    handler_ref: str
    payload: bytes
    headers: dict[str, str]
    status: Status
    created_at: int
    first_attempt: Attempt | None
    next_attempt_at: int | None = None
    dead_reason: ErrorInfo | None = None
    handler_version: str | None = None
    payload_content_type: str = "application/octet-stream"
    id: str = field(default_factory=new_task_id)
    # ordering: key (SPEC §12). A PARKED new task is stored PARKED when its key has an open task, else PENDING due
    # at `created_at` (decided in the store, in the insert: nothing can end in between).
    order_key: str | None = None
    order_seq: int | None = None
    order_hold: bool = False
    # False: the first attempt is in the history but not counted against max_attempts (a record in flight when
    # its bridge died, whose attempt would have been its last: source/first_delivery.py, `suspect_task`).
    first_attempt_counted: bool = True

    def __post_init__(self) -> None:
        if self.status == Status.PENDING and self.next_attempt_at is None:
            raise ValueError("a PENDING task needs next_attempt_at")
        if self.status == Status.DEAD and self.dead_reason is None:
            raise ValueError("a DEAD task needs a dead_reason")
        if self.status not in (Status.PENDING, Status.DEAD, Status.PARKED):
            raise ValueError("a new task is PENDING, DEAD or PARKED")
        if self.status == Status.PARKED and self.order_key is None:
            raise ValueError("a PARKED task needs an order_key")

    def params(self) -> dict[str, Any]:
        dead = self.status == Status.DEAD
        return {
            "id": self.id, "queue": self.queue, "handler_ref": self.handler_ref,
            "handler_version": self.handler_version, "payload": self.payload,
            "payload_content_type": self.payload_content_type,
            "headers": headers_json(self.headers), "status": self.status.value,
            "attempt_count": 1 if self.first_attempt and self.first_attempt_counted else 0,
            "next_attempt_at": None if dead else self.next_attempt_at, "created_at": self.created_at,
            "finished_at": self.created_at if dead else None,
            "dead_reason_type": self.dead_reason.type if self.dead_reason else None,
            "dead_reason_message": self.dead_reason.message if self.dead_reason else None,
            "dlq_state": "PENDING" if dead else None, "source_ref": self.source_ref,
            **home_params(home_of(self.headers)),
            "order_key": self.order_key, "order_seq": self.order_seq, "order_hold": int(self.order_hold),
        }  # fmt: skip

    @property
    def source_ref(self) -> str | None:
        """The source record this task stands for: `rdq.source` and the record's timestamp."""
        source = self.headers.get("rdq.source")
        return None if source is None else f"{source}@{self.headers.get('rdq.kafka.timestamp', '')}"
