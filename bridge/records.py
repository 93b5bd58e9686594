"""Source records and the headers that follow them (SPEC §3, §4.1).

A lane runs the fetched records as they came (`Fetched`: confluent-kafka's Message); a record becomes a
`SourceRecord` only when it needs to (it fails, parks, is a suspect, is traced, or its handler is async): a
success on the common path costs no object of its own.

A task's headers are a flat string map. The Kafka record's key, timestamp and own headers (names and bytes,
duplicates and binary values included) are kept losslessly, base64 where bytes may not be UTF-8, so the DLQ
record can carry them exactly as they came.
"""

from __future__ import annotations

import base64
import json
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

TP = tuple[str, int]  # a source partition: (topic, partition)
SOURCE = "rdq.source"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
KEY_B64 = "rdq.kafka.key"  # base64 of the key bytes; absent when the record had no key
TIMESTAMP = "rdq.kafka.timestamp"  # ms since the epoch, as the record carried it
HEADERS_JSON = "rdq.kafka.headers"  # JSON [[name, base64 value or null], ...], in record order
CONTENT_TYPE_HEADERS = ("content-type", "Content-Type", "contentType")

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


def new_traceparent(sampled: bool = True) -> str:
    # Random, not cryptographic: trace ids need uniqueness (W3C trace-context), and os.urandom per record costs a
    # system call (the OpenTelemetry SDK's own id generator uses `random` too).
    return f"00-{random.getrandbits(128):032x}-{random.getrandbits(64) or 1:016x}-{'01' if sampled else '00'}"


def valid_traceparent(value: str | None) -> bool:
    if not value:
        return False
    match = _TRACEPARENT.match(value.strip())
    return bool(match) and set(match.group(1)) != {"0"} and set(match.group(2)) != {"0"}  # type: ignore[union-attr]


def trace_id(traceparent: str) -> str:
    return traceparent.split("-")[1]


class Fetched(Protocol):
    """A fetched record as a lane holds it: confluent-kafka's Message, or a `FetchedRecord`."""

    def topic(self) -> str: ...
    def partition(self) -> int: ...
    def offset(self) -> int: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def headers(self) -> list[tuple[str, bytes | None]] | None: ...
    def timestamp(self) -> tuple[int, int]: ...
    def __len__(self) -> int: ...  # the value's bytes


def content_type_of(headers: Any) -> str:
    """The first of the content-type headers with a UTF-8 value (each name's first occurrence), else
    application/octet-stream."""
    if not headers:
        return "application/octet-stream"
    for name in CONTENT_TYPE_HEADERS:
        for key, value in headers:
            if key == name:
                text = _text(value)
                if text:
                    return text
                break
    return "application/octet-stream"


def _text(value: bytes | None) -> str | None:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


def source_of(record: Fetched) -> str:
    return f"kafka://{record.topic()}/{record.partition()}/{record.offset()}"


@dataclass(slots=True)
class SourceRecord:
    """One fetched record (not frozen: a frozen dataclass's __init__ costs a microsecond more per record)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp: int | None
    headers: tuple[tuple[str, bytes | None], ...]

    @classmethod
    def from_message(cls, msg: Any) -> SourceRecord:
        ts_type, ts = msg.timestamp()
        return cls(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value() or b"",
                   ts if ts_type != 0 else None, tuple(msg.headers() or ()))

    @property
    def source(self) -> str:
        return f"kafka://{self.topic}/{self.partition}/{self.offset}"

    def header(self, name: str) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def header_text(self, name: str) -> str | None:
        return _text(self.header(name))

    @property
    def content_type(self) -> str:
        return content_type_of(self.headers)

    def fetched(self) -> FetchedRecord:
        """This record in a lane's shape (put back to run again, or a test's)."""
        return FetchedRecord(self)

    def task_headers(self, sampled: bool = True) -> dict[str, str]:
        """`rdq.source`, a valid `traceparent` (the record's, or a new trace), key, timestamp, own headers."""
        traceparent = self.header_text(TRACEPARENT)
        own_trace = valid_traceparent(traceparent)
        headers = {SOURCE: self.source,
                   TRACEPARENT: traceparent if own_trace and traceparent else new_traceparent(sampled)}
        tracestate = self.header_text(TRACESTATE)
        if tracestate and own_trace:
            headers[TRACESTATE] = tracestate
        if self.key is not None:
            headers[KEY_B64] = base64.b64encode(self.key).decode("ascii")
        if self.timestamp is not None:
            headers[TIMESTAMP] = str(self.timestamp)
        if self.headers:
            headers[HEADERS_JSON] = json.dumps(
                [[k, None if v is None else base64.b64encode(v).decode("ascii")] for k, v in self.headers],
                separators=(",", ":"))
        return headers


class FetchedRecord:
    """A SourceRecord in the fetched Message's shape (`Fetched`): a record that goes back into its lane."""

    __slots__ = ("record",)

    def __init__(self, record: SourceRecord) -> None:
        self.record = record

    def topic(self) -> str:
        return self.record.topic

    def partition(self) -> int:
        return self.record.partition

    def offset(self) -> int:
        return self.record.offset

    def key(self) -> bytes | None:
        return self.record.key

    def value(self) -> bytes:
        return self.record.value

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        return list(self.record.headers) or None

    def timestamp(self) -> tuple[int, int]:
        ts = self.record.timestamp
        return (0, 0) if ts is None else (1, ts)  # (TIMESTAMP_NOT_AVAILABLE, 0) or (TIMESTAMP_CREATE_TIME, ts)

    def __len__(self) -> int:
        return len(self.record.value)


def source_record(record: SourceRecord | Fetched) -> SourceRecord:
    """A fetched record as a SourceRecord (made when a record needs one: it failed, parks, is a suspect)."""
    if isinstance(record, SourceRecord):
        return record
    if isinstance(record, FetchedRecord):
        return record.record
    return SourceRecord.from_message(record)


class TaskHeaders(Mapping[str, str]):
    """A record's task headers (`SourceRecord.task_headers`), made on first use: a handler that succeeds reading
    only `rdq.source` (or nothing) never pays for a new trace id, base64 and JSON (nor, for a fetched record, a
    SourceRecord). Made once, then fixed: the headers a handler saw are the ones its task stores."""

    __slots__ = ("_made", "_record", "sampled")

    def __init__(self, record: SourceRecord | Fetched, sampled: bool = True) -> None:
        self._record = record
        self._made: dict[str, str] | None = None
        self.sampled = sampled  # the trace flag a record without a traceparent gets

    def made(self) -> dict[str, str]:
        if self._made is None:
            self._made = self.record().task_headers(self.sampled)
        return self._made

    def record(self) -> SourceRecord:
        """Their record as a SourceRecord (a fetched one's made once: its task and these headers share it)."""
        record = self._record
        if not isinstance(record, SourceRecord):
            record = self._record = source_record(record)
        return record

    def _source(self) -> str:
        record = self._record
        return record.source if isinstance(record, SourceRecord) else source_of(record)

    def __getitem__(self, key: str) -> str:
        if key == SOURCE and self._made is None:
            return self._source()
        return self.made()[key]

    def get(self, key: str, default: Any = None) -> Any:
        if key == SOURCE and self._made is None:
            return self._source()
        return self.made().get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self.made())

    def __len__(self) -> int:
        return len(self.made())

    def __repr__(self) -> str:
        return repr(self.made())


def parse_source(value: str | None) -> tuple[str, int, int] | None:
    """`kafka://topic/partition/offset` → (topic, partition, offset); None when it is not one."""
    if not value or not value.startswith("kafka://"):
        return None
    parts = value[len("kafka://"):].rsplit("/", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2])


def source_key(headers: dict[str, str]) -> bytes | None:
    value = headers.get(KEY_B64)
    return None if value is None else base64.b64decode(value)


def source_headers(headers: dict[str, str]) -> list[tuple[str, bytes | None]]:
    value = headers.get(HEADERS_JSON)
    if not value:
        return []
    return [(k, None if v is None else base64.b64decode(v)) for k, v in json.loads(value)]
