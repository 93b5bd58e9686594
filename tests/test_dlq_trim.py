"""DLQ envelope trimming (SPEC §6) without a broker: what is kept, and that it is not quadratic."""

from __future__ import annotations

import json

import pytest

import bridge.dlq.envelope
from bridge.dlq.envelope import build_record
from bridge.model import Attempt, ErrorInfo, Outcome, Status, Task


def dead_task(attempts: int, message: int = 200, stack: int = 3000) -> Task:
    history = tuple(Attempt(n, 0, 1_000, 2_000, Outcome.RETRYABLE_FAILURE,
                            ErrorInfo("E", "m" * message, "s" * stack), "w") for n in range(1, attempts + 1))
    return Task("01TASK", "q", "h", None, b"p" * 1000, "application/octet-stream", {"rdq.source": "kafka://t/0/1"},
                Status.DEAD, attempts, 0, None, None, 0, None, None, 0, 0, 3_000, None, ErrorInfo("E", "dead"),
                "PENDING", None, None, None, history)


def test_a_long_history_is_trimmed_with_a_bounded_number_of_encodings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropping middle attempts used to re-encode the whole envelope once per dropped attempt (quadratic, on the
    event loop). Now each removed attempt costs its own small encoding; the envelope is encoded a few times."""
    task = dead_task(2000)
    whole = len(json.dumps(bridge.dlq.envelope.envelope(task), separators=(",", ":")))
    big_encodings = 0
    original = bridge.dlq.envelope._encode

    def counting(body: dict) -> bytes:  # type: ignore[type-arg]
        nonlocal big_encodings
        out = original(body)
        big_encodings += len(out) > 20_000
        return out

    monkeypatch.setattr(bridge.dlq.envelope, "_encode", counting)
    record = build_record(task, 150_000)
    assert whole > 150_000 and record.size <= 150_000
    assert big_encodings <= 12
    body = json.loads(record.value)
    kept = [a["attempt_no"] for a in body["attempts"]]
    removed = [r["attempt_no"] for r in body["trimmed"]["attempts_removed"]]
    assert kept[0] == 1 and kept[-1] == 2000 and sorted(kept + removed) == list(range(1, 2001))


@pytest.mark.parametrize("limit", [60_000, 100_000, 400_000])
def test_trimming_fits_as_tightly_as_it_says(limit: int) -> None:
    record = build_record(dead_task(300, message=3000), limit)
    assert record.size <= limit
    body = json.loads(record.value)
    assert len(body["attempts"]) + len(body["trimmed"].get("attempts_removed", [])) == 300


def test_the_envelope_encoding_is_byte_for_byte_compact_json() -> None:
    """_encode uses orjson for speed; its bytes must be those of the stdlib's compact, non-ASCII-escaping JSON."""
    import json
    import random

    from bridge.dlq.envelope import _encode

    rng = random.Random(7)
    for _ in range(2000):
        text = "".join(chr(rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))
                       for _ in range(rng.randint(0, 30)))
        body = {"a": text, "n": rng.randint(-2**62, 2**62), "list": [None, True, False, {"x": text}], text: 1}
        assert _encode(body) == json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def test_rfc3339_matches_datetime_formatting_to_the_millisecond() -> None:
    import datetime as dt
    import random

    from bridge.model import rfc3339

    rng = random.Random(3)
    for ms in [0, 1, 999, 1000, -1, -1000, -1001, 1_800_000_000_123, *(rng.randint(-10**12, 4 * 10**12)
                                                                          for _ in range(20_000))]:
        expected = dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        assert rfc3339(ms) == expected, ms
