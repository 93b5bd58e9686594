"""Records of another system's dead-letter topic → DEAD tasks (SPEC §13, `rdq import`), and this project's own
envelope. Pure: no Kafka, no store.

Formats, told apart by their headers:
- Spring Kafka (`DeadLetterPublishingRecoverer`): `kafka_dlt-original-topic` (UTF-8), `-original-partition`
  (4-byte big-endian int), `-original-offset` and `-original-timestamp` (8-byte big-endian longs),
  `-original-consumer-group`, `kafka_dlt-exception-fqcn`, `-exception-message`, `-exception-stacktrace`.
- Kafka Connect (`errors.deadletterqueue.context.headers.enable`): `__connect.errors.topic`, `.partition`,
  `.offset` (decimal strings), `.connector.name`, `.task.id`, `.stage`, `.exception.class.name`,
  `.exception.message`, `.exception.stacktrace`.
- Kafka share groups (KIP-1191): `__dlq.errors.topic`, `.partition`, `.offset`, `.group`, `.delivery.count`,
  `.message`. Kafka 4.4 writes pointer-only records by default (no value, no key): the importer reads the original
  record from its source topic (`pointer`, then `to_task(..., original=...)`).
- rdq (SPEC §6): the `rdq.dead-letter/v1` JSON envelope: the task itself, with its id and history.

A record that is none of these, or one whose headers cannot be read (a partition that is not a number), is refused
with the reason: a task is made from a whole record or not at all. The task id of a foreign record is derived from
where that record is (its DLQ topic, partition, offset): importing it twice makes one task.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ulid import ULID

from bridge.dlq.envelope import SCHEMA
from bridge.model import Attempt, ErrorInfo, Outcome, Status, Task
from bridge.records import SourceRecord

SPRING, CONNECT, SHARE_GROUP, RDQ = "spring-kafka", "kafka-connect", "share-group", "rdq"
IMPORTED_FROM = "rdq.imported.from"  # kafka://dlq-topic/partition/offset of the record a task was imported from
IMPORTED_FORMAT = "rdq.imported.format"

Headers = Sequence[tuple[str, bytes | None]]


class NotImportable(ValueError):
    """Why a record is not imported (per record; the others go on)."""


@dataclass(frozen=True)
class DlqRecord:
    topic: str
    partition: int
    offset: int
    timestamp: int | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]

    @property
    def where(self) -> str:
        return f"kafka://{self.topic}/{self.partition}/{self.offset}"

    @classmethod
    def from_message(cls, msg: Any) -> DlqRecord:
        """From a confluent-kafka message."""
        kind, timestamp = msg.timestamp()
        return cls(msg.topic(), msg.partition(), msg.offset(), timestamp if kind != 0 else None, msg.key(),
                   msg.value(), tuple(msg.headers() or ()))


@dataclass(frozen=True)
class Failure:
    """What a foreign format says about a record's failure."""

    format: str
    prefix: str  # its headers' common prefix: they are not the record's own headers
    topic: str | None
    partition: int | None
    offset: int | None
    timestamp: int | None
    error_type: str
    message: str
    stack: str | None
    deliveries: int
    note: str


def _text(headers: Headers, name: str) -> str | None:
    for key, value in headers:
        if key == name and value is not None:
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError as e:
                raise NotImportable(f"header {name} is not UTF-8") from e
    return None


_INT64 = 2**63 - 1
_MAX_TIME_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: past it, no date can be written
# What each number may be: a Kafka partition is an int32, an offset an int64, a delivery count small.
_RANGES = {"partition": (0, 2**31 - 1), "offset": (0, _INT64), "timestamp": (0, _MAX_TIME_MS),
           "delivery.count": (0, 2**31 - 1)}


def _number(headers: Headers, name: str) -> int | None:
    """A decimal string (Kafka Connect, KIP-1191) or a big-endian 4/8-byte integer (Spring Kafka), within the
    range its kind allows (a partition, an offset, a timestamp); else the record is refused, saying why."""
    raw = next((v for k, v in headers if k == name and v is not None), None)
    if raw is None:
        return None
    if raw and raw.lstrip(b"-").isdigit() and len(raw) <= 20:
        value = int(raw)
    elif raw and raw.lstrip(b"-").isdigit():
        raise NotImportable(f"header {name} is a number of {len(raw)} digits")
    elif len(raw) in (4, 8):
        value = int.from_bytes(raw, "big", signed=True)
    else:
        raise NotImportable(f"header {name} is neither a decimal number nor a 4/8-byte integer: {raw[:16]!r}")
    kind = next((k for k in _RANGES if name.endswith(k)), None)
    low, high = _RANGES[kind] if kind is not None else (-_INT64 - 1, _INT64)
    if not low <= value <= high:
        raise NotImportable(f"header {name} is out of range for a {kind or 'number'}: {value}")
    return value


def _timestamp(value: int | None) -> int | None:
    """A Kafka record's own timestamp as a task time: None when it is not one (negative, or past year 9999)."""
    return value if value is not None and 0 <= value <= _MAX_TIME_MS else None


def _spring(headers: Headers) -> Failure:
    p = "kafka_dlt-"
    group = _text(headers, p + "original-consumer-group")
    return Failure(SPRING, p, _text(headers, p + "original-topic"), _number(headers, p + "original-partition"),
                   _number(headers, p + "original-offset"), _number(headers, p + "original-timestamp"),
                   _text(headers, p + "exception-fqcn") or "spring-kafka.UnknownException",
                   _text(headers, p + "exception-message") or "", _text(headers, p + "exception-stacktrace"), 1,
                   "dead-lettered by Spring Kafka" + (f" (consumer group {group})" if group else ""))


def _connect(headers: Headers) -> Failure:
    p = "__connect.errors."
    connector, task, stage = (_text(headers, p + n) for n in ("connector.name", "task.id", "stage"))
    where = ", ".join(f"{k} {v}" for k, v in (("connector", connector), ("task", task), ("stage", stage)) if v)
    return Failure(CONNECT, p, _text(headers, p + "topic"), _number(headers, p + "partition"),
                   _number(headers, p + "offset"), None,
                   _text(headers, p + "exception.class.name") or "kafka-connect.UnknownException",
                   _text(headers, p + "exception.message") or "", _text(headers, p + "exception.stacktrace"), 1,
                   "dead-lettered by Kafka Connect" + (f" ({where})" if where else ""))


def _share_group(headers: Headers) -> Failure:
    p = "__dlq.errors."
    group, count = _text(headers, p + "group"), _number(headers, p + "delivery.count")
    return Failure(SHARE_GROUP, p, _text(headers, p + "topic"), _number(headers, p + "partition"),
                   _number(headers, p + "offset"), None, "kafka.share.Undeliverable",
                   _text(headers, p + "message") or "rejected or out of delivery attempts", None, max(1, count or 1),
                   f"dead-lettered by share group {group or '?'}" + (f" after {count} deliveries" if count else ""))


FORMATS: tuple[tuple[str, Callable[[Headers], Failure]], ...] = (
    ("kafka_dlt-", _spring), ("__connect.errors.", _connect), ("__dlq.errors.", _share_group))


def _is_envelope(value: bytes | None) -> bool:
    try:
        data = json.loads(value or b"")
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("schema") == SCHEMA


def decode_envelope(value: bytes) -> Task:
    """The task of an `rdq.dead-letter/v1` envelope, or raise NotImportable saying why it is not one."""
    try:
        envelope = json.loads(value)
        if envelope.get("schema") != SCHEMA:
            raise ValueError(f"schema is {envelope.get('schema')!r}, not {SCHEMA}")
        attempts = tuple(Attempt.from_json(a) for a in envelope.get("attempts", []))
        return Task.from_json(envelope["task"], attempts)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as e:
        raise NotImportable(f"not an rdq DLQ envelope: {type(e).__name__}: {str(e)[:200]}") from e


def imported_id(record: DlqRecord, created_at: int) -> str:
    """A ULID (the original record's time, then 80 bits of a hash of where the DLQ record is): the same record
    imported twice gets the same id."""
    digest = hashlib.sha256(record.where.encode()).digest()[:10]
    return str(ULID.from_bytes(max(0, created_at).to_bytes(6, "big") + digest))


def pointer(record: DlqRecord) -> tuple[str, int, int] | None:
    """Where the original of a pointer-only share-group record is (Kafka 4.4 writes no copy of the record by
    default: `errors.deadletterqueue.copy.record.enable=false`, headers and no value); None for any other record."""
    if record.value is not None or not any(k.startswith("__dlq.errors.") for k, _ in record.headers):
        return None
    try:
        failure = _share_group(record.headers)
    except NotImportable:
        return None  # refused by to_task, with its reason
    if failure.topic is None or failure.partition is None or failure.offset is None:
        return None
    return failure.topic, failure.partition, failure.offset


def to_task(record: DlqRecord, queue: str, handler_ref: str, original: DlqRecord | None = None) -> tuple[str, Task]:
    """(format, the DEAD task) for one DLQ record, or raise NotImportable: never anything else, whatever the
    record holds (each record is imported or refused alone). `original`: the record a pointer-only share-group
    record points to (`pointer`), read from its source topic; its key, value and headers make the task."""
    try:
        kind, task = _to_task(record if original is None else _resolved(record, original), queue, handler_ref)
        _storable(task)
        return kind, task
    except NotImportable:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        raise NotImportable(f"cannot be read as a task: {type(e).__name__}: {str(e)[:200]}") from e


def _storable(task: Task) -> None:
    """Every number fits SQLite's INTEGER and every time is a date its readers can write out (an envelope may say
    `attempt_count: 1e30` or a time in the year 300,000)."""
    numbers = [v for v in vars(task).values() if isinstance(v, int) and not isinstance(v, bool)]
    numbers += [v for a in task.attempts for v in vars(a).values() if isinstance(v, int) and not isinstance(v, bool)]
    if any(not -_INT64 - 1 <= v <= _INT64 for v in numbers):
        raise NotImportable("a number of the task is out of range for a 64-bit integer")
    task.to_json()  # times as dates, payload as base64
    for attempt in task.attempts:
        attempt.to_json()


def _to_task(record: DlqRecord, queue: str, handler_ref: str) -> tuple[str, Task]:
    for prefix, parse in FORMATS:
        if any(k.startswith(prefix) for k, _ in record.headers):
            return _from_failure(record, parse(record.headers), queue, handler_ref)
    if _is_envelope(record.value):
        return RDQ, _from_envelope(record, queue, handler_ref)
    raise NotImportable("unknown format: no kafka_dlt-* (Spring Kafka), __connect.errors.* (Kafka Connect) or "
                        f"__dlq.errors.* (share group) header, and not an {SCHEMA} envelope")


def _resolved(record: DlqRecord, original: DlqRecord) -> DlqRecord:
    """A pointer with what it points to: the original's key, value and own headers, the pointer's failure headers
    (and its place, so the task id still says which DLQ record it came from)."""
    failure_headers = tuple((k, v) for k, v in record.headers if k.startswith("__dlq.errors."))
    own = tuple((k, v) for k, v in original.headers if not k.startswith("__dlq.errors."))
    return replace(record, key=original.key, value=original.value if original.value is not None else b"",
                   headers=own + failure_headers)


def _from_failure(record: DlqRecord, failure: Failure, queue: str, handler_ref: str) -> tuple[str, Task]:
    if failure.topic is None or failure.partition is None or failure.offset is None:
        raise NotImportable(f"{failure.format} record without its original topic, partition and offset")
    if failure.format == SHARE_GROUP and record.value is None:
        raise NotImportable(f"a pointer-only share-group record whose original kafka://{failure.topic}/"
                            f"{failure.partition}/{failure.offset} is gone (retention or compaction removed it, or "
                            "the topic was deleted): there is no payload to redrive")
    finished = _timestamp(record.timestamp) or failure.timestamp or 0
    created = failure.timestamp or finished
    own = tuple((k, v) for k, v in record.headers if not k.startswith(failure.prefix))
    source = SourceRecord(failure.topic, failure.partition, failure.offset, record.key, record.value or b"",
                          failure.timestamp, own)
    headers = {**source.task_headers(), IMPORTED_FROM: record.where, IMPORTED_FORMAT: failure.format}
    error = ErrorInfo(failure.error_type, failure.message, failure.stack)
    attempt = Attempt(failure.deliveries, 0, finished, finished, Outcome.PERMANENT_FAILURE, error,
                      f"imported from {failure.format}", seq=1, note=failure.note)
    task = Task(id=imported_id(record, created), queue=queue, handler_ref=handler_ref, handler_version=None,
                payload=record.value or b"", payload_content_type=source.content_type, headers=headers,
                status=Status.DEAD, attempt_count=failure.deliveries, redrive_count=0, next_attempt_at=None,
                lease_expires_at=None, lease_token=0, lease_owner=None, lease_started_at=None, created_at=created,
                life_started_at=created, finished_at=finished, fetched_at=None,
                dead_reason=ErrorInfo(failure.error_type, failure.message), dlq_state="PUBLISHED",
                dlq_topic=record.topic, dlq_partition=record.partition, dlq_offset=record.offset,
                attempts=(attempt,))
    return failure.format, task


def _from_envelope(record: DlqRecord, queue: str, handler_ref: str) -> Task:
    """This project's own envelope: the task as it was, same id and history, now of `queue`."""
    task = decode_envelope(record.value or b"")
    if task.status != Status.DEAD:
        raise NotImportable(f"the envelope's task is {task.status.value}, not DEAD")
    headers = {**task.headers, IMPORTED_FROM: record.where, IMPORTED_FORMAT: RDQ}
    return replace(task, queue=queue, handler_ref=handler_ref, headers=headers)
