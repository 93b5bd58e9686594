"""Foreign dead-letter records → DEAD tasks (SPEC §13; pure: the broker round trip is test_import_kafka)."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from bridge.dlq import envelope
from bridge.foreign_dlq import (
    CONNECT,
    IMPORTED_FORMAT,
    IMPORTED_FROM,
    RDQ,
    SHARE_GROUP,
    SPRING,
    DlqRecord,
    NotImportable,
    to_task,
)
from bridge.model import ErrorInfo, Outcome, Status, Task
from bridge.records import HEADERS_JSON, KEY_B64, SOURCE, TIMESTAMP, TRACEPARENT

TRACE = f"00-{'ab' * 16}-{'cd' * 8}-01"


def spring_headers(partition: int = 2, offset: int = 41, ts: int = 1_700_000_000_000) -> list[tuple[str, bytes]]:
    """As Spring Kafka's DeadLetterPublishingRecoverer writes them: numbers as big-endian int / long."""
    return [("kafka_dlt-original-topic", b"orders"), ("kafka_dlt-original-partition", struct.pack(">i", partition)),
            ("kafka_dlt-original-offset", struct.pack(">q", offset)),
            ("kafka_dlt-original-timestamp", struct.pack(">q", ts)),
            ("kafka_dlt-original-timestamp-type", b"CreateTime"),
            ("kafka_dlt-original-consumer-group", b"billing"),
            ("kafka_dlt-exception-fqcn", b"org.springframework.kafka.listener.ListenerExecutionFailedException"),
            ("kafka_dlt-exception-message", b"Listener failed; amount < 0"),
            ("kafka_dlt-exception-stacktrace",
             b"org.springframework...\n\tat com.acme.Billing.charge(Billing.java:42)")]


CONNECT_HEADERS = [("__connect.errors.topic", b"orders"), ("__connect.errors.partition", b"1"),
                   ("__connect.errors.offset", b"7"), ("__connect.errors.connector.name", b"jdbc-sink"),
                   ("__connect.errors.task.id", b"0"), ("__connect.errors.stage", b"VALUE_CONVERTER"),
                   ("__connect.errors.class.name", b"org.apache.kafka.connect.json.JsonConverter"),
                   ("__connect.errors.exception.class.name", b"org.apache.kafka.connect.errors.DataException"),
                   ("__connect.errors.exception.message", b"Converting byte[] to Kafka Connect data failed"),
                   ("__connect.errors.exception.stacktrace", b"org.apache.kafka.connect.errors.DataException: ...")]

SHARE_HEADERS = [("__dlq.errors.topic", b"orders"), ("__dlq.errors.partition", b"0"), ("__dlq.errors.offset", b"99"),
                 ("__dlq.errors.group", b"orders-share"), ("__dlq.errors.delivery.count", b"5"),
                 ("__dlq.errors.message", b"max delivery attempts reached")]


def record(headers: list[tuple[str, bytes]], value: bytes | None = b'{"amount": -5}', offset: int = 3,
           key: bytes | None = b"acct-42") -> DlqRecord:
    return DlqRecord("legacy.DLT", 0, offset, 1_700_000_100_000, key, value, tuple(headers))


def test_spring_kafka_binary_headers_map_to_a_dead_task_with_its_history() -> None:
    kind, task = to_task(record([*spring_headers(), (TRACEPARENT, TRACE.encode()), ("tenant", b"eu")]), "q", "h")
    assert kind == SPRING and task.status == Status.DEAD and task.queue == "q" and task.handler_ref == "h"
    assert task.headers[SOURCE] == "kafka://orders/2/41" and task.headers[TIMESTAMP] == "1700000000000"
    assert task.headers[TRACEPARENT] == TRACE and base64.b64decode(task.headers[KEY_B64]) == b"acct-42"
    assert task.headers[IMPORTED_FROM] == "kafka://legacy.DLT/0/3" and task.headers[IMPORTED_FORMAT] == SPRING
    own = json.loads(task.headers[HEADERS_JSON])  # the record's own headers, not Spring's error headers
    assert [name for name, _ in own] == [TRACEPARENT, "tenant"]
    assert task.payload == b'{"amount": -5}' and task.created_at == 1_700_000_000_000
    assert task.dead_reason == ErrorInfo("org.springframework.kafka.listener.ListenerExecutionFailedException",
                                         "Listener failed; amount < 0")
    [attempt] = task.attempts
    assert attempt.outcome == Outcome.PERMANENT_FAILURE and attempt.error is not None
    assert "Billing.java:42" in (attempt.error.stack or "") and "consumer group billing" in (attempt.note or "")
    assert (task.dlq_topic, task.dlq_partition, task.dlq_offset) == ("legacy.DLT", 0, 3)


def test_kafka_connect_string_headers() -> None:
    kind, task = to_task(record(CONNECT_HEADERS), "q", "h")
    assert kind == CONNECT and task.headers[SOURCE] == "kafka://orders/1/7"
    assert task.dead_reason is not None and task.dead_reason.type == "org.apache.kafka.connect.errors.DataException"
    assert "connector jdbc-sink, task 0, stage VALUE_CONVERTER" in (task.attempts[0].note or "")


def test_share_group_dlq_headers_carry_the_delivery_count() -> None:
    kind, task = to_task(record(SHARE_HEADERS), "q", "h")
    assert kind == SHARE_GROUP and task.headers[SOURCE] == "kafka://orders/0/99"
    assert task.attempt_count == 5 and task.attempts[0].attempt_no == 5
    assert task.dead_reason is not None and task.dead_reason.message == "max delivery attempts reached"
    assert "share group orders-share after 5 deliveries" in (task.attempts[0].note or "")


def test_our_own_envelope_keeps_its_id_and_history_and_takes_the_import_queue() -> None:
    _, original = to_task(record(spring_headers()), "old-queue", "old-handler")
    value = json.dumps(envelope(original)).encode()
    kind, task = to_task(record([], value=value, offset=8), "q", "h")
    assert kind == RDQ and task.id == original.id
    assert [a.to_json() for a in task.attempts] == [a.to_json() for a in original.attempts]
    assert task.queue == "q" and task.handler_ref == "h" and task.payload == original.payload
    assert task.headers[IMPORTED_FROM] == "kafka://legacy.DLT/0/8"


def test_the_same_record_gets_the_same_id_and_another_record_another() -> None:
    one = to_task(record(CONNECT_HEADERS), "q", "h")[1].id
    assert to_task(record(CONNECT_HEADERS), "q", "h")[1].id == one
    assert to_task(record(CONNECT_HEADERS, offset=4), "q", "h")[1].id != one
    assert Task is not None and len(one) == 26  # a ULID


@pytest.mark.parametrize(("headers", "value", "why"), [
    ([("content-type", b"application/json")], b'{"a": 1}', "unknown format"),
    ([], b"not json at all", "unknown format"),
    ([], json.dumps({"schema": "someone-else/v1"}).encode(), "unknown format"),
    ([("kafka_dlt-exception-fqcn", b"java.lang.RuntimeException")], b"x", "without its original topic"),
    ([*spring_headers()[:1], ("kafka_dlt-original-partition", b"\x01\x02\x03"),
      *spring_headers()[2:]], b"x", "neither a decimal number"),
    ([("__connect.errors.topic", b"\xff\xfe"), *CONNECT_HEADERS[1:]], b"x", "not UTF-8"),
])
def test_a_record_that_is_not_importable_is_refused_with_the_reason(headers: list[tuple[str, bytes]],
                                                                    value: bytes, why: str) -> None:
    with pytest.raises(NotImportable, match=why):
        to_task(record(headers, value=value), "q", "h")
