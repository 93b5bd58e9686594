"""Source records and the headers that follow them (SPEC §3, §4.1).

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
from typing import Any

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
        value = self.header(name)
        if value is None:
            return None
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None

    @property
    def content_type(self) -> str:
        if not self.headers:
            return "application/octet-stream"
        for name in CONTENT_TYPE_HEADERS:
            value = self.header_text(name)
            if value:
                return value
        return "application/octet-stream"

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


class TaskHeaders(Mapping[str, str]):
    """A record's task headers (`SourceRecord.task_headers`), made on first use: a handler that succeeds reading
    only `rdq.source` (or nothing) never pays for a new trace id, base64 and JSON. Made once, then fixed: the
    headers a handler saw are the ones its task stores."""

    __slots__ = ("_made", "_record", "sampled")

    def __init__(self, record: SourceRecord, sampled: bool = True) -> None:
        self._record = record
        self._made: dict[str, str] | None = None
        self.sampled = sampled  # the trace flag a record without a traceparent gets

    def made(self) -> dict[str, str]:
        if self._made is None:
            self._made = self._record.task_headers(self.sampled)
        return self._made

    def __getitem__(self, key: str) -> str:
        if key == SOURCE and self._made is None:
            return self._record.source
        return self.made()[key]

    def get(self, key: str, default: Any = None) -> Any:
        if key == SOURCE and self._made is None:
            return self._record.source
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
