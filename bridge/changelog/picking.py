"""A batch of changelog records reduced to each task's last word, as rows the store's restore statements bind.

Pure (no store, no Kafka): it runs on the restore thread, or in the decoding process (`decoder.py`), whose results
cross a pipe: a task is one small tuple (`Row`), not the dicts `codec.decode` gives, which cost more to unpickle
than to decode again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

from bridge.changelog.codec import Checked, Unreadable, check

Record = tuple[int, bytes | None, bytes | None]  # offset, key, value (None: a tombstone)

# The columns restore_tasks, restore_attempts and restore_redrives bind (queries.sql), in their order.
TASK_ROW = ("id", "queue", "handler_ref", "handler_version", "payload", "payload_content_type", "headers", "status",
            "attempt_count", "redrive_count", "next_attempt_at", "lease_expires_at", "lease_token", "lease_owner",
            "lease_started_at", "created_at", "life_started_at", "finished_at", "fetched_at", "dead_reason_type",
            "dead_reason_message", "dlq_state", "dlq_topic", "dlq_partition", "dlq_offset", "source_ref",
            "home_topic", "home_partition", "order_key", "order_seq", "order_hold")
ATTEMPT_ROW = ("task_id", "seq", "attempt_no", "redrive_no", "started_at", "finished_at", "outcome", "error_type",
               "error_message", "error_stack", "worker", "late_result_of", "note")
REDRIVE_ROW = ("task_id", "redrive_no", "at", "by", "request_id", "key_id")

# A task's row straight from its decoded record's fields, in three runs around the values the record does not hold as
# the store does (the content type, the headers as text, the source reference): no dict between.
_HEADERS_AT, _SOURCE_AT = TASK_ROW.index("headers"), TASK_ROW.index("source_ref")
assert TASK_ROW[_HEADERS_AT - 1] == "payload_content_type" and _HEADERS_AT < _SOURCE_AT
_task_head = attrgetter(*TASK_ROW[: _HEADERS_AT - 1])
_task_middle = attrgetter(*TASK_ROW[_HEADERS_AT + 1 : _SOURCE_AT])
_task_tail = attrgetter(*TASK_ROW[_SOURCE_AT + 1 :])
_redrive_row = itemgetter(*REDRIVE_ROW)
_attempt_row = attrgetter(*ATTEMPT_ROW[1:])


class Row(NamedTuple):
    """A restored task as the store writes it: its tasks row (TASK_ROW, then the version), its history as one
    value (None: as `attempts` rows, see codec.Restored.history) and its redrives' rows."""

    task: tuple[Any, ...]
    version: int
    source_ref: str | None
    history: bytes | None  # packed (bridge/store/history.py)
    attempts: tuple[tuple[Any, ...], ...]
    redrives: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(cls, checked: Checked) -> Row:
        record = checked.record
        body, version = record.task, record.version
        attempts = () if checked.history is not None else tuple(
            (body.id, *_attempt_row(a)) for a in record.attempts)
        task = (*_task_head(body), checked.content_type, checked.headers, *_task_middle(body), checked.source_ref,
                *_task_tail(body), version)
        return cls(task, version, checked.source_ref, checked.history if record.attempts else None, attempts,
                   tuple(_redrive_row(r) for r in record.redrives))


@dataclass
class Picked:
    """Each task's last word in a batch (`pick_last`).

    `last`: each task's state (None: a tombstone); `held`: tasks whose last record cannot be read (offset, why;
    quarantined); `raw`: where in `records` each readable last record is; `unreadable`: every unreadable record
    (offset, key, value, why), kept in changelog_unreadable. `records`: the batch (left empty by the decoding
    process: the restorer, which has it, puts it back instead of having it sent back)."""

    last: dict[str, Row | None]
    held: dict[str, tuple[int, str]]
    raw: dict[str, int]
    unreadable: list[tuple[int, bytes | None, bytes, str]]
    records: list[Record] = field(default_factory=list)
    applied: int = 0
    tombstones: int = 0
    seconds: float = field(default=0.0, compare=False)  # spent decoding (in whichever thread or process did)

    def record_of(self, task_id: str) -> tuple[int, bytes | None, bytes]:
        offset, key, value = self.records[self.raw[task_id]]
        return offset, key, value or b""


def pick_last(records: list[Record], yield_every: int = 0, keep: bool = True) -> Picked:
    """Each task's last record of the batch, in log order. A later record holds a task's whole state, so only the
    last counts. `keep`: the batch is kept in `records` (not by the decoding process).

    `yield_every`: give the GIL up every that many records. The restore decodes on its own thread while the store's
    thread applies the batch before: that thread gives the GIL up in every SQLite step and, to take it back from a
    thread that does not give it up, waits a switch interval (5 ms) each time; measured, it applied 3x slower."""
    began = time.perf_counter()
    picked = Picked({}, {}, {}, [], records if keep else [])
    last, held = picked.last, picked.held
    for n, (offset, key, value) in enumerate(records):
        if yield_every and n % yield_every == 0:
            time.sleep(0)
        if value is None:
            task_id = (key or b"").decode("utf-8", "replace")
            last.pop(task_id, None)  # re-inserted at the end: the tombstone is its last word
            last[task_id] = None
            held.pop(task_id, None)
            picked.tombstones += 1
            continue
        try:
            checked = check(key, value)
        except Unreadable as e:
            picked.unreadable.append((offset, key, value, str(e)))
            owner = _task_id_of(key)
            if owner is not None:
                last.pop(owner, None)
                held[owner] = (offset, str(e))
            continue
        task_id = checked.record.task.id
        last.pop(task_id, None)
        last[task_id] = Row.of(checked)
        held.pop(task_id, None)
        picked.raw[task_id] = n
        picked.applied += 1
    picked.seconds = time.perf_counter() - began
    return picked


def _task_id_of(key: bytes | None) -> str | None:
    """The task an unreadable record is of: its record key (the task id; compaction keeps a key's last record)."""
    if not key:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None
