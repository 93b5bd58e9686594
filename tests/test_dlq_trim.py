"""DLQ envelope trimming (SPEC §6) without a broker: what is kept, and that it is not quadratic."""

from __future__ import annotations

import json
from pathlib import Path

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

    from bridge.clock import rfc3339

    rng = random.Random(3)
    for ms in [0, 1, 999, 1000, -1, -1000, -1001, 1_800_000_000_123, *(rng.randint(-10**12, 4 * 10**12)
                                                                          for _ in range(20_000))]:
        expected = dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        assert rfc3339(ms) == expected, ms


async def test_the_outbox_draft_carries_what_the_decoded_task_would(tmp_path: Path) -> None:
    """The publisher embeds each attempt as SQLite encoded it (attempts_json_of_many), never decoding it. Its
    record must say what the record built from the decoded task says: every field, times to the millisecond,
    late_result_of and note only when set, text with any character; and trim the same way when it must."""
    import random
    import sqlite3

    from bridge.dlq.envelope import draft_record, fitted
    from bridge.store.queries import q
    from bridge.store.tasks import Store
    from tests.helpers import failure

    rng = random.Random(11)

    def text(longest: int) -> str:
        return "".join(chr(rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))
                       for _ in range(rng.randint(0, longest)))

    store = await Store.open(tmp_path / "s.db")
    ids = [await store.submit(failure(dead=ErrorInfo("E", text(40)), now=1_000 + i)) for i in range(40)]
    conn = sqlite3.connect(tmp_path / "s.db")
    for task_id in ids:
        for seq in range(2, rng.randint(2, 9)):
            error = rng.random() < 0.8
            conn.execute(q("insert_attempt_copy"), {
                "task_id": task_id, "seq": seq, "attempt_no": seq, "redrive_no": rng.randint(0, 3),
                "started_at": rng.randint(0, 4 * 10**12),
                "finished_at": rng.choice([0, 999, rng.randint(0, 4 * 10**12)]),
                "outcome": rng.choice(list(Outcome)).value, "error_type": text(20) if error else None,
                "error_message": rng.choice([None, text(60)]) if error else None,
                "error_stack": rng.choice([None, text(400)]) if error else None, "worker": rng.choice([None, text(10)]),
                "late_result_of": rng.choice([None, rng.randint(1, 9)]), "note": rng.choice([None, text(30)]),
            })  # fmt: skip
    conn.commit()
    conn.close()
    entries = await store.dlq_outbox_entries(limit=100)
    assert sorted(e.task.id for e in entries) == sorted(ids)
    for entry in entries:
        task = await store.get(entry.task.id)
        assert task is not None
        decoded, draft = build_record(task, 10**9), draft_record(entry.task, entry.attempts_json)
        assert json.loads(draft.value) == json.loads(decoded.value)
        assert (draft.key, draft.headers) == (decoded.key, decoded.headers)
        limit = decoded.size * 2 // 3
        trimmed_decoded, trimmed_draft = build_record(task, limit), fitted(draft, limit)
        assert trimmed_draft.trimmed is not None and trimmed_draft.trimmed == trimmed_decoded.trimmed
        assert json.loads(trimmed_draft.value) == json.loads(trimmed_decoded.value)
    await store.close()
