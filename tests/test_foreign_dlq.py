"""Foreign dead-letter records → DEAD tasks (SPEC §13; pure: the broker round trip is test_import_kafka)."""

from __future__ import annotations

import base64
import json
import struct

import hypothesis
import pytest
from hypothesis import strategies as st

from bridge.dlq.envelope import envelope
from bridge.dlq.foreign import (
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
    assert len(one) == 26 and Task.from_json  # a ULID
    assert str(__import__("ulid").ULID.from_str(one)) == one


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


def _spring_with(name: str, value: bytes) -> list[tuple[str, bytes]]:
    return [(k, value if k == name else v) for k, v in spring_headers()]


@pytest.mark.parametrize(("headers", "value", "why"), [
    # A Spring timestamp of 0x7fff…ff: OverflowError once, and the rest of the range was not imported.
    (_spring_with("kafka_dlt-original-timestamp", b"\x7f" + b"\xff" * 7), b"x", "out of range for a timestamp"),
    (_spring_with("kafka_dlt-original-partition", struct.pack(">i", -3)), b"x", "out of range for a partition"),
    # A 5,000-digit Connect offset: ValueError (Python's int() digit limit).
    ([(k, b"9" * 5000 if k == "__connect.errors.offset" else v) for k, v in CONNECT_HEADERS], b"x",
     "a number of 5000 digits"),
    ([(k, b"-1" if k == "__dlq.errors.offset" else v) for k, v in SHARE_HEADERS], b"x", "out of range"),
])
def test_a_malformed_number_refuses_its_record_with_the_reason(headers: list[tuple[str, bytes]], value: bytes,
                                                               why: str) -> None:
    with pytest.raises(NotImportable, match=why):
        to_task(record(headers, value=value), "q", "h")


@pytest.mark.parametrize("change", [
    lambda e: e["task"].update(attempt_count=float("inf")),  # `attempt_count: Infinity`: OverflowError once
    lambda e: e["task"].update(attempt_count=10**30),
    lambda e: e["task"].update(created_at="year 300000"),
    lambda e: e["attempts"].append({"attempt_no": "x"}),
    lambda e: e.update(task=[]),
])
def test_a_malformed_envelope_is_refused_and_so_is_its_redrive(change: object) -> None:
    from bridge.dlq.foreign import decode_envelope

    original = to_task(record(CONNECT_HEADERS), "q", "h")[1]
    body = json.loads(json.dumps(envelope(original)))
    change(body)  # type: ignore[operator]
    value = json.dumps(body).encode()
    with pytest.raises(NotImportable):
        to_task(record([], value=value), "q", "h")
    if isinstance(body.get("task"), dict) and body["task"].get("attempt_count") == float("inf"):
        with pytest.raises(NotImportable):  # a redrive from that DLQ record reads it the same way
            decode_envelope(value)


NAMES = [k for k, _ in spring_headers() + CONNECT_HEADERS + SHARE_HEADERS] + ["content-type", "rdq.source", ""]
NUMBERS = st.one_of(st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()),
                    st.integers(-(2**63), 2**63 - 1).map(lambda n: struct.pack(">q", n)),
                    st.integers(-(2**31), 2**31 - 1).map(lambda n: struct.pack(">i", n)))
HEADER = st.tuples(st.one_of(st.sampled_from(NAMES), st.text(max_size=30)),
                   st.one_of(st.none(), st.binary(max_size=40), NUMBERS))


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(headers=st.lists(HEADER, max_size=14), value=st.one_of(st.none(), st.binary(max_size=200)),
                  timestamp=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
                  key=st.one_of(st.none(), st.binary(max_size=20)), offset=st.integers(0, 2**63 - 1))
def test_any_foreign_record_is_imported_or_refused_never_an_error(headers: list[tuple[str, bytes | None]],
                                                                 value: bytes | None, timestamp: int | None,
                                                                 key: bytes | None, offset: int) -> None:
    """Arbitrary header bytes, sizes and numbers: a task that can be stored and shown, or NotImportable."""
    dlq = DlqRecord("legacy.DLT", 0, offset, timestamp, key, value, tuple(headers))
    try:
        kind, task = to_task(dlq, "q", "h")
    except NotImportable as e:
        assert str(e)
        return
    assert kind in (SPRING, CONNECT, SHARE_GROUP, RDQ)
    assert task.status == Status.DEAD and task.attempts and json.dumps(task.to_json())
    assert all(-(2**63) <= n <= 2**63 - 1 for n in (task.created_at, task.finished_at or 0, task.attempt_count))


@st.composite
def mutated_headers(draw: st.DrawFn) -> list[tuple[str, bytes | None]]:
    """A real format's headers, some of their values replaced by arbitrary bytes or numbers of any size."""
    base = draw(st.sampled_from([spring_headers(), CONNECT_HEADERS, SHARE_HEADERS]))
    out = []
    for name, value in base:
        out.append((name, draw(st.one_of(st.none(), st.binary(max_size=12), NUMBERS)) if draw(st.booleans())
                    else value))
    return out


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(headers=mutated_headers(), timestamp=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)))
def test_any_mutation_of_a_real_format_is_imported_or_refused(headers: list[tuple[str, bytes | None]],
                                                             timestamp: int | None) -> None:
    dlq = DlqRecord("legacy.DLT", 0, 5, timestamp, b"k", b"v", tuple(headers))
    try:
        _, task = to_task(dlq, "q", "h")
    except NotImportable as e:
        assert str(e)
        return
    assert json.dumps(task.to_json()) and all(json.dumps(a.to_json()) for a in task.attempts)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(task=st.fixed_dictionaries({
    "attempt_count": st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.none()),
    "created_at": st.one_of(st.integers(), st.floats(), st.text(max_size=30)),
    "status": st.one_of(st.sampled_from(["DEAD", "PENDING", "x"]), st.integers())}))
def test_any_envelope_is_imported_or_refused_never_an_error(task: dict[str, object]) -> None:
    original = to_task(record(CONNECT_HEADERS), "q", "h")[1]
    body = json.loads(json.dumps(envelope(original)))
    body["task"].update(task)
    try:
        _, imported = to_task(record([], value=json.dumps(body).encode()), "q", "h")
    except NotImportable as e:
        assert str(e).startswith(("not an rdq", "cannot be read", "the envelope", "a number"))
        return
    assert imported.status == Status.DEAD and json.dumps(imported.to_json())
