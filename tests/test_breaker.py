"""The circuit breaker's state machine (SPEC §11), on a fake clock: what trips it, what it holds, how it probes."""

from __future__ import annotations

from bridge.clock import FakeClock
from bridge.config import BreakerConfig
from bridge.engine.breaker import Breaker, State
from bridge.model import Outcome

OK, RETRY, PERMANENT, LAPSED = (Outcome.SUCCESS, Outcome.RETRYABLE_FAILURE, Outcome.PERMANENT_FAILURE,
                                Outcome.LEASE_EXPIRED)


class Clocks(FakeClock):
    """Wall time for the held intervals and monotonic time for the window, advanced together."""

    def monotonic(self) -> float:
        return self.ms / 1000


def breaker(**settings: object) -> tuple[Breaker, Clocks]:
    clock = Clocks()
    config = BreakerConfig(**{"window": 10, "min_attempts": 20, "failure_ratio": 0.8, "open_for": 5,
                              "max_open_for": 40, "reset_after": 60, "probes": 2, "ramp": 10, **settings})
    return Breaker("q", lambda: config, clock, clock.monotonic), clock


def test_an_outage_trips_it_once_enough_attempts_failed_retryably() -> None:
    b, _ = breaker()
    assert b.record([RETRY] * 19) is None  # below min_attempts: a few failures are records' business
    transition = b.record([LAPSED])
    assert transition is not None and transition.after == State.OPEN and "20 of the last 20" in transition.why
    assert b.holds() and b.concurrency(8) == 0


def test_successes_given_as_a_count_weigh_as_listed_ones() -> None:
    """A lane's chunks report their successes as a count beside the other outcomes (`record(outcomes, n)`)."""
    b, _ = breaker()
    assert b.record([RETRY] * 20, successes=10) is None  # 20 of 30: below the ratio
    b, _ = breaker()
    transition = b.record([RETRY] * 16, successes=4)  # 16 of 20: at the ratio, at min_attempts
    assert transition is not None and "16 of the last 20" in transition.why


def test_poison_records_and_permanent_failures_never_trip_it() -> None:
    b, clock = breaker()
    for _ in range(100):  # 1 in 50 fails for good, 1 in 50 retryably: far below the ratio
        assert b.record([OK] * 48 + [PERMANENT, RETRY]) is None
        clock.advance(0.1)
    assert b.record([PERMANENT] * 500) is None  # the downstream answers "no": it is up
    assert b.state == State.CLOSED and b.concurrency(8) == 8


def test_failures_older_than_the_window_do_not_count() -> None:
    b, clock = breaker()
    b.record([RETRY] * 15)
    clock.advance(11)
    assert b.record([RETRY] * 15) is None  # 15 in the window, not 30
    assert b.record([RETRY] * 5) is not None


def test_half_open_after_open_for_then_a_probe_success_closes_with_a_ramp() -> None:
    b, clock = breaker()
    b.record([RETRY] * 20)
    clock.advance(4.9)
    assert b.tick() is None
    clock.advance(0.1)
    transition = b.tick()
    assert transition is not None and transition.after == State.HALF_OPEN
    assert b.holds() and b.concurrency(8) == 2  # the probes
    assert b.record([RETRY] * 100) is None  # attempts that were running when it tripped decide nothing
    b.probes_out = 1
    transition = b.probe_result(OK)
    assert transition is not None and transition.after == State.CLOSED and b.probes_out == 0
    assert not b.holds()
    assert b.concurrency(8) == 2  # the ramp starts at the probes...
    clock.advance(5)
    assert b.concurrency(8) == 5  # ...grows...
    clock.advance(5)
    assert b.concurrency(8) == 8  # ...to the queue's concurrency


def test_a_failed_probe_reopens_it_for_twice_as_long_up_to_the_max() -> None:
    b, clock = breaker()
    b.record([RETRY] * 20)
    durations = []
    for _ in range(5):
        clock.advance(b.open_for)
        assert b.tick() is not None
        durations.append(b.open_for)
        transition = b.probe_result(RETRY)
        assert transition is not None and transition.after == State.OPEN
    assert durations == [5, 10, 20, 40, 40]
    assert b.probe_result(OK) is None  # not half-open: a stray result changes nothing


def test_a_flapping_downstream_waits_longer_each_time_it_re_trips_soon_after_closing() -> None:
    b, clock = breaker()
    transitions = 0
    for _ in range(12):  # a minute and more of 2 s up, 2 s down
        if b.record([RETRY] * 20) is not None:
            transitions += 1
        clock.advance(b.open_for)
        if b.tick() is not None:
            transitions += 1
        if b.probe_result(OK) is not None:
            transitions += 1
        clock.advance(2)
    assert b.open_for == 40  # doubled on each re-trip within reset_after, up to max_open_for
    clock.advance(61)
    b.record([RETRY] * 20)
    assert b.open_for == 5  # an outage long after the last one starts over


def test_an_operator_holds_it_open_until_closed_and_the_held_time_is_measured() -> None:
    b, clock = breaker()
    since = clock.now_ms()
    transition = b.force_open("alice")
    assert transition is not None and transition.after == State.OPEN and "alice" in transition.why
    clock.advance(3600)
    assert b.tick() is None  # no half-open while an operator holds it
    assert b.status()["forced_by"] == "alice"
    transition = b.force_close("alice")
    assert transition is not None and transition.after == State.CLOSED
    clock.advance(10)
    assert b.waited_ms(since, clock.now_ms()) == 3_600_000
    assert b.waited_ms(clock.now_ms() - 5000, clock.now_ms()) == 0
    assert b.force_close("alice") is None


def test_nothing_to_probe_with_closes_it_and_a_disabled_breaker_never_trips() -> None:
    b, clock = breaker()
    b.record([RETRY] * 20)
    clock.advance(5)
    b.tick()
    assert b.nothing_to_probe() is not None and b.state == State.CLOSED
    off, _ = breaker(enabled=False)
    assert off.record([RETRY] * 1000) is None and off.state == State.CLOSED


def test_a_note_travels_with_its_attempt_and_older_records_without_one_still_read() -> None:
    """The note is in the DLQ envelope's attempt (only when there is one: older envelopes stay byte-identical)
    and in the changelog record; a changelog record written before notes existed still restores."""
    import json

    from bridge.changelog.codec import decode, encode
    from bridge.model import Attempt

    noted = Attempt(2, 0, 1_800_000_000_000, 1_800_000_001_000, OK, note="waited 4.2s for the queue's circuit breaker")
    plain = Attempt(1, 0, 1_800_000_000_000, 1_800_000_001_000, RETRY)
    assert noted.to_json()["note"].startswith("waited 4.2s") and "note" not in plain.to_json()
    assert Attempt.from_json(noted.to_json()).note == noted.note
    task = {name: None for name in ("id", "queue", "handler_ref", "handler_version", "payload_content_type",
                                    "status", "next_attempt_at", "lease_expires_at", "lease_owner",
                                    "lease_started_at", "finished_at", "fetched_at", "dead_reason_type",
                                    "dead_reason_message", "dlq_state", "dlq_topic", "dlq_partition", "dlq_offset",
                                    "home_topic", "home_partition", "order_key", "order_seq",
                                    "order_hold")}
    task.update(id="t1", queue="q", handler_ref="h", status="PENDING", next_attempt_at=1, attempt_count=2,
                redrive_count=0, lease_token=1, created_at=1, life_started_at=1, headers="{}", payload=b"x")
    rows = [{**plain.params("t1"), "seq": 1}, {**noted.params("t1"), "seq": 2}]
    restored = decode(b"t1", encode(task, rows, [], 3))
    assert [a.note for a in restored.attempts] == [None, noted.note]
    old = json.loads(encode(task, rows, [], 3))
    for attempt in old["attempts"]:
        del attempt["note"]
    assert [a.note for a in decode(b"t1", json.dumps(old).encode()).attempts] == [None, None]  # it reads
