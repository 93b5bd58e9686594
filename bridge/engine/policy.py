"""Retry policy as small immutable values: classify an outcome, then decide "retry after N s" or "dead".

The policy is never stored on a task: it is resolved from the live queue config at the moment it is needed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from bridge.config import BackoffConfig, ErrorsConfig, QueueConfig
from bridge.handler_api import Permanent, Retry
from bridge.model import Outcome, error_type_name


@dataclass(frozen=True)
class Decision:
    """None `retry_after`: dead-letter. Otherwise retry after that many seconds."""

    retry_after: float | None

    @property
    def dead(self) -> bool:
        return self.retry_after is None


DEAD = Decision(None)


def backoff_delay(backoff: BackoffConfig, attempt: int, rand: Callable[[], float] = random.random) -> float:
    """Delay before the attempt after `attempt` (1-based) failed."""
    if backoff.kind == "fixed":
        delay = backoff.base
    else:
        # Cap the exponent so a huge attempt count cannot overflow a float before `max` applies.
        delay = backoff.base * backoff.factor ** min(attempt - 1, 1000)
    delay = min(delay, backoff.max)
    if backoff.effective_jitter == "full":
        delay *= rand()
    return delay


_NAMES: dict[type[BaseException], frozenset[str]] = {}  # a type's names, asked at each failure: 2.4 us to walk


def _names(exc_type: type[BaseException]) -> frozenset[str]:
    """Every name an `errors:` list may give the type by."""
    known = _NAMES.get(exc_type)
    if known is not None:
        return known
    if len(_NAMES) >= 512:  # types made on the fly would otherwise be kept for ever
        _NAMES.clear()
    names = set()
    for klass in exc_type.__mro__:
        names.add(klass.__qualname__)
        names.add(f"{klass.__module__}.{klass.__qualname__}")
        names.add(error_type_name(klass))  # the name it had before it moved, where it moved
    _NAMES[exc_type] = frozenset(names)
    return _NAMES[exc_type]


def classify(exc: BaseException, errors: ErrorsConfig) -> Outcome:
    """Explicit signals first, then the queue's lists (exception names, matched along the class hierarchy)."""
    if isinstance(exc, Permanent):
        return Outcome.PERMANENT_FAILURE
    if isinstance(exc, Retry):
        return Outcome.RETRYABLE_FAILURE
    if errors.permanent or errors.retryable:
        names = _names(type(exc))
        if not names.isdisjoint(errors.permanent):
            return Outcome.PERMANENT_FAILURE
        if not names.isdisjoint(errors.retryable):
            return Outcome.RETRYABLE_FAILURE
    return Outcome.PERMANENT_FAILURE if errors.default == "permanent" else Outcome.RETRYABLE_FAILURE


def bounded_delay(queue: QueueConfig, requested: float | None) -> float | None:
    """A delay a handler or a peer asked for, made safe: None when absent or not a number (NaN: the backoff
    applies), at least 0, at most `max_retry_after` and `queue_timeout` (an infinite or huge value must not
    overflow a timestamp, nor park a task past its whole-life bound)."""
    if not isinstance(requested, int | float) or isinstance(requested, bool):
        return None
    if isinstance(requested, float) and math.isnan(requested):  # (an int may be too large for isnan's float)
        return None
    ceiling = min(queue.max_retry_after, queue.queue_timeout or math.inf)
    return float(min(max(0.0, requested), ceiling))  # compare before converting: an int may not fit a float


def decide(queue: QueueConfig, outcome: Outcome, attempt_count: int, requested_delay: float | None = None,
           rand: Callable[[], float] = random.random) -> Decision:
    """After a failed attempt: retry (when attempts remain) or dead-letter."""
    if outcome == Outcome.PERMANENT_FAILURE or attempt_count >= queue.max_attempts:
        return DEAD
    delay = bounded_delay(queue, requested_delay)
    if delay is not None:
        return Decision(delay)
    return Decision(backoff_delay(queue.backoff, attempt_count, rand))
