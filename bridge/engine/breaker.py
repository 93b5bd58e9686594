"""Per-queue circuit breakers (SPEC §11): an outage holds the queue's work instead of spending its attempts.

A breaker counts the queue's attempts in a sliding window. Only retryable failures (and lapsed leases) count as
failures: a permanent failure, `rdq.Unroutable` or a version mismatch is a property of its record, and a
downstream that answers "no" is up. When enough attempts ran and most failed, the breaker opens: the consumer
pauses the queue's source partitions, the scheduler claims nothing (due tasks stay PENDING, their attempt counts
unchanged) and a claimed-ahead task not yet started is handed back uncounted. Attempts already running finish
and are recorded as always. After `open_for` it is half-open: `probes` tasks run; a success closes it (the
consumer resumes, retries are claimed at a limit ramping up to the queue's concurrency), a failure re-opens it for
twice as long (up to `max_open_for`). An operator can hold a queue open (`breaker open`) or close it.

The breakers live in memory: a restarted bridge starts closed and re-trips within one window if the outage goes on
(the records it then fails are stored tasks, as always; nothing is lost either way).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from bridge.clock import Clock
from bridge.config import BreakerConfig
from bridge.live_config import LiveConfig
from bridge.model import Outcome
from bridge.telemetry.core import Metrics

log = logging.getLogger(__name__)

FAILURES = frozenset({Outcome.RETRYABLE_FAILURE, Outcome.LEASE_EXPIRED})
_HELD_KEPT = 32  # held intervals remembered per queue (for the notes on the attempts that waited)


class State(StrEnum):
    CLOSED = "closed"
    HALF_OPEN = "half-open"
    OPEN = "open"


_GAUGE = {State.CLOSED: 0, State.HALF_OPEN: 1, State.OPEN: 2}


@dataclass(frozen=True)
class Transition:
    queue: str
    before: State
    after: State
    why: str


class Breaker:
    """One queue's breaker. Not thread-safe: used from the event loop only."""

    def __init__(self, queue: str, config: Callable[[], BreakerConfig], clock: Clock,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self._config = config
        self._clock = clock  # wall time, for the held intervals the attempts' notes refer to
        self._now = now  # monotonic, for the window and the open duration
        self.state = State.CLOSED
        self.forced_by: str | None = None  # an operator's `breaker open`: no half-open until `breaker close`
        self._buckets: collections.deque[list[float]] = collections.deque()  # [second, attempts, failures]
        self.open_for = config().open_for
        self._opened_at = 0.0
        self._closed_at: float | None = None
        self.probes_out = 0
        self.held: collections.deque[list[int | None]] = collections.deque(maxlen=_HELD_KEPT)  # [from_ms, to_ms]
        self.last_why = ""

    @property
    def config(self) -> BreakerConfig:
        return self._config()

    # ---- what the attempts report ----------------------------------------------------------------------

    def record(self, outcomes: Sequence[Outcome], successes: int = 0) -> Transition | None:
        """Count attempts that ran while closed (first deliveries, retries): `outcomes`, and `successes` more that
        succeeded. Outcomes arriving while open or half-open (attempts that were running when it tripped) are
        recorded by their tasks but decide nothing."""
        config = self.config
        if not config.enabled or self.state != State.CLOSED:
            return None
        now = self._now()
        second = float(int(now))
        bucket = self._buckets[-1] if self._buckets and self._buckets[-1][0] == second else None
        if bucket is None:
            bucket = [second, 0.0, 0.0]
            self._buckets.append(bucket)
        bucket[1] += len(outcomes) + successes
        bucket[2] += sum(map(FAILURES.__contains__, outcomes))  # a C loop: a lane's batch may be thousands
        while self._buckets and self._buckets[0][0] <= now - config.window:
            self._buckets.popleft()
        attempts = sum(b[1] for b in self._buckets)
        failures = sum(b[2] for b in self._buckets)
        if attempts >= config.min_attempts and failures / attempts >= config.failure_ratio:
            return self._open(f"{failures:.0f} of the last {attempts:.0f} attempts in {config.window:g}s failed "
                              f"retryably (trips at {config.failure_ratio:g} of at least {config.min_attempts})")
        return None

    def probe_result(self, outcome: Outcome) -> Transition | None:
        """The outcome of a half-open probe: a retryable failure re-opens (for longer); anything else — a success,
        or a permanent failure (the downstream answered) — closes."""
        self.probes_out = max(0, self.probes_out - 1)
        if self.state != State.HALF_OPEN:
            return None
        if outcome in FAILURES:
            return self._open(f"a probe failed ({outcome.value})", escalate=True)
        return self._close(f"a probe ended {outcome.value}")

    def probe_void(self) -> None:
        """A probe that ended without a verdict (its lease lost, handed back, cancelled): its slot is free for the
        next probe; the breaker stays where it is."""
        self.probes_out = max(0, self.probes_out - 1)

    # ---- what the scheduler and the consumer ask --------------------------------------------------------

    def holds(self) -> bool:
        """The queue's source partitions stay paused (open or half-open)."""
        return self.state != State.CLOSED

    def concurrency(self, queue_concurrency: int) -> int:
        """How many of the queue's retries may run now: none while open, the probes while half-open, and for
        `ramp` after closing a limit growing from `probes` to the queue's concurrency."""
        config = self.config
        if self.state == State.OPEN:
            return 0
        if self.state == State.HALF_OPEN:
            return min(queue_concurrency, config.probes)
        if self._closed_at is None or config.ramp <= 0:
            return queue_concurrency
        elapsed = self._now() - self._closed_at
        if elapsed >= config.ramp:
            return queue_concurrency
        share = config.probes + (queue_concurrency - config.probes) * elapsed / config.ramp
        return max(1, min(queue_concurrency, int(share)))

    def nothing_to_probe(self) -> Transition | None:
        """Half-open and no task waits to probe with: close (a still-failing downstream re-trips it, for longer:
        within `reset_after` of closing the open duration doubles)."""
        if self.state != State.HALF_OPEN or self.probes_out:
            return None
        return self._close("half-open with no task to probe with")

    def tick(self) -> Transition | None:
        if self.state == State.OPEN and self.forced_by is None and self._now() - self._opened_at >= self.open_for:
            self.probes_out = 0
            return self._move(State.HALF_OPEN, f"open for {self.open_for:g}s: probing with "
                                               f"{self.config.probes} task(s)")
        return None

    def waited_ms(self, since_ms: int, until_ms: int) -> int:
        """How long, of [since, until], the queue was held by this breaker (for the note on the next attempt)."""
        total = 0
        for start, end in self.held:
            assert start is not None
            stop = until_ms if end is None else end
            total += max(0, min(stop, until_ms) - max(start, since_ms))
        return total

    # ---- an operator's hand -----------------------------------------------------------------------------

    def force_open(self, by: str) -> Transition | None:
        self.forced_by = by
        if self.state == State.OPEN:
            return None
        return self._open(f"opened by {by}")

    def force_close(self, by: str) -> Transition | None:
        self.forced_by = None
        self.open_for = self.config.open_for
        if self.state == State.CLOSED:
            return None
        return self._close(f"closed by {by}")

    def status(self) -> dict[str, Any]:
        config = self.config
        attempts = sum(b[1] for b in self._buckets)
        failures = sum(b[2] for b in self._buckets)
        out: dict[str, Any] = {"state": self.state.value, "enabled": config.enabled, "why": self.last_why,
                               "window_attempts": int(attempts), "window_failures": int(failures),
                               "open_for_s": self.open_for}
        if self.forced_by is not None:
            out["forced_by"] = self.forced_by
        if self.state == State.OPEN and self.forced_by is None:
            out["half_open_in_s"] = round(max(0.0, self.open_for - (self._now() - self._opened_at)), 3)
        return out

    # ---- transitions -------------------------------------------------------------------------------------

    def _open(self, why: str, escalate: bool = False) -> Transition:
        config = self.config
        recently = self._closed_at is not None and self._now() - self._closed_at < config.reset_after
        if self.state == State.CLOSED:
            # A re-trip soon after closing is the same outage (or a flapping one): wait longer before probing.
            self.open_for = min(self.open_for * 2, config.max_open_for) if recently else config.open_for
            self.held.append([self._clock.now_ms(), None])
        elif escalate:
            self.open_for = min(self.open_for * 2, config.max_open_for)
        self._opened_at = self._now()
        return self._move(State.OPEN, why)

    def _close(self, why: str) -> Transition:
        if self.held and self.held[-1][1] is None:
            self.held[-1][1] = self._clock.now_ms()
        self._closed_at = self._now()
        self._buckets.clear()
        return self._move(State.CLOSED, why)

    def _move(self, to: State, why: str) -> Transition:
        before, self.state, self.last_why = self.state, to, why
        return Transition(self.queue, before, to, why)


class Breakers:
    """The breakers of every queue; reports transitions (log, metrics, `on_change` listeners)."""

    def __init__(self, config: LiveConfig, clock: Clock, metrics: Metrics | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics
        self._now = now
        self._breakers: dict[str, Breaker] = {}
        self.on_change: list[Callable[[Transition], None]] = []

    def of(self, queue: str) -> Breaker:
        breaker = self._breakers.get(queue)
        if breaker is None:
            breaker = self._breakers[queue] = Breaker(queue, lambda: self._config_of(queue), self.clock, self._now)
            if self.metrics is not None:
                self.metrics.breaker_state.labels(queue).set(0)
        return breaker

    def _config_of(self, queue: str) -> BreakerConfig:
        found = self.config.queue(queue)
        if found is None or found.remote:
            # Remote workers claim over their socket, past the scheduler that runs the half-open probes.
            return BreakerConfig(enabled=False)
        return found.breaker

    def holding(self) -> set[str]:
        return {name for name, b in self._breakers.items() if b.holds()}

    def record(self, queue: str, outcomes: Sequence[Outcome], successes: int = 0) -> None:
        self.report(self.of(queue).record(outcomes, successes))

    def report(self, transition: Transition | None) -> None:
        if transition is None:
            return
        level = logging.WARNING if transition.after == State.OPEN else logging.INFO
        log.log(level, "circuit breaker %s → %s: %s", transition.before.value, transition.after.value,
                transition.why, extra={"queue": transition.queue})
        if self.metrics is not None:
            self.metrics.breaker_state.labels(transition.queue).set(_GAUGE[transition.after])
            self.metrics.breaker_transitions.labels(transition.queue, transition.after.value).inc()
        for listener in self.on_change:
            listener(transition)

    def status(self) -> dict[str, dict[str, Any]]:
        """Every configured queue's breaker (and any left from a queue a reload removed)."""
        for name in self.config.queue_names():
            self.of(name)
        return {name: b.status() for name, b in sorted(self._breakers.items())}

    async def run(self, stop: asyncio.Event, interval: float = 0.1) -> None:
        """Open → half-open when each breaker's time is up."""
        while not stop.is_set():
            for breaker in list(self._breakers.values()):
                self.report(breaker.tick())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
