"""What the store answers and takes: the result of a transition, a handler run's report, a redriven task, sweep
counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bridge.model import Attempt, ErrorInfo, Outcome, Status


@dataclass(frozen=True)
class Result:
    """The answer to a post-claim mutation. `accepted=False`: stale token or terminal task, nothing changed."""

    accepted: bool
    status: Status | None = None
    attempt_no: int | None = None
    late: bool = False  # a success accepted from a stale holder (first result wins, SPEC §4.5)


@dataclass(frozen=True)
class RunReport:
    """What a handler run produced, before the store numbers it."""

    started_at: int
    finished_at: int
    outcome: Outcome
    error: ErrorInfo | None = None
    worker: str | None = None
    note: str | None = None  # kept with the attempt (e.g. it waited for the queue's circuit breaker)


@dataclass(frozen=True)
class Redriven:
    """A task a redrive moved back to PENDING."""

    id: str
    queue: str
    headers: dict[str, str]


@dataclass(frozen=True)
class SweepCounts:
    lease_expired: int = 0
    timed_out: int = 0
    purged: int = 0


def attempt_params(task_id: str, report: RunReport, attempt_no: int, redrive_no: int,
                    late_result_of: int | None = None) -> dict[str, Any]:
    attempt = Attempt(attempt_no, redrive_no, report.started_at, report.finished_at, report.outcome,
                      report.error, report.worker, late_result_of, note=report.note)
    return attempt.params(task_id)
