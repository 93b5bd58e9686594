"""Time, injectable: the engine reads `now_ms()`; tests drive a FakeClock. And how times are written (RFC 3339)."""

from __future__ import annotations

import datetime as dt
import functools
import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class FakeClock:
    def __init__(self, start_ms: int = 1_800_000_000_000) -> None:
        self.ms = start_ms

    def now_ms(self) -> int:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += round(seconds * 1000)


def rfc3339(ms: int | None) -> str | None:
    """ms since the epoch → `2026-07-20T14:03:22.200Z` (a DLQ envelope has a dozen of these per task)."""
    if ms is None:
        return None
    return f"{_rfc3339_seconds(ms // 1000)}.{ms % 1000:03d}Z"


@functools.lru_cache(maxsize=4096)
def _rfc3339_seconds(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def parse_rfc3339(value: str | None) -> int | None:
    """`2026-07-20T14:03:22.200Z` → ms since the epoch (the inverse of rfc3339)."""
    if value is None:
        return None
    parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return round(parsed.timestamp() * 1000)
