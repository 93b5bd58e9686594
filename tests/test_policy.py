"""Retry policy values: backoff shapes and the bounds on a delay a handler or a peer asks for."""

from __future__ import annotations

import math

import pytest
import yaml

from bridge.config import ConfigError, QueueConfig, parse_config
from bridge.engine.policy import backoff_delay, bounded_delay, decide
from bridge.handler_api import Retry
from bridge.model import Outcome


def queue(**kw: object) -> QueueConfig:
    return QueueConfig.model_validate({"handler": "h", **kw})


def test_a_fixed_backoff_waits_what_it_says_unless_jitter_is_asked_for() -> None:
    fixed = queue(backoff={"kind": "fixed", "base": "4s"}).backoff
    assert [backoff_delay(fixed, n, rand=lambda: 0.125) for n in (1, 2, 5)] == [4.0, 4.0, 4.0]
    jittered = queue(backoff={"kind": "fixed", "base": "4s", "jitter": "full"}).backoff
    assert backoff_delay(jittered, 1, rand=lambda: 0.125) == 0.5
    exponential = queue(backoff={"kind": "exponential", "base": "1s"}).backoff  # documented default: full
    assert backoff_delay(exponential, 3, rand=lambda: 0.5) == 2.0


@pytest.mark.parametrize(("asked", "expected"), [
    (30.0, 30.0), (0.0, 0.0), (-5.0, 0.0), (math.inf, 3600.0), (1e300, 3600.0), (2**70, 3600.0),
    (math.nan, None), (None, None), (10**400, 3600.0), (-(10**400), 0.0),
])
def test_a_requested_delay_is_bounded(asked: float | None, expected: float | None) -> None:
    assert bounded_delay(queue(max_retry_after="1h"), asked) == expected


def test_a_requested_delay_never_passes_the_queue_timeout() -> None:
    assert bounded_delay(queue(max_retry_after="1d", queue_timeout="10m"), math.inf) == 600.0
    decision = decide(queue(queue_timeout="10m"), Outcome.RETRYABLE_FAILURE, 1, 1e12)
    assert decision.retry_after == 600.0


def test_nan_falls_back_to_the_backoff() -> None:
    q = queue(backoff={"kind": "fixed", "base": "7s"})
    assert decide(q, Outcome.RETRYABLE_FAILURE, 1, math.nan).retry_after == 7.0


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_retry_refuses_a_negative_or_nan_delay(bad: float) -> None:
    with pytest.raises(ValueError, match="seconds >= 0"):
        Retry(after=bad)


@pytest.mark.parametrize("bad", [".inf", "1e300", "-1", ".nan"])
def test_durations_cannot_be_infinite_huge_or_negative(bad: str) -> None:
    tree = {"kafka": {"bootstrap_servers": "x"},
            "queues": {"q": {"handler": "h", "backoff": {"max": yaml.safe_load(bad)}}}}
    with pytest.raises(ConfigError, match=r"queues\.q\.backoff\.max"):
        parse_config(tree)


def test_a_huge_http_retry_after_is_bounded_too() -> None:
    from bridge.workers.http_handler import HttpRetryableError, classify_response

    with pytest.raises(HttpRetryableError) as caught:
        classify_response(503, {"Retry-After": "9" * 40}, "busy", "POST http://app")
    assert caught.value.after is not None and caught.value.after > 1e39
    decision = decide(queue(max_retry_after="2h"), Outcome.RETRYABLE_FAILURE, 1, caught.value.after)
    assert decision.retry_after == 7200.0


def test_errors_lists_match_along_the_class_hierarchy_whatever_was_asked_before() -> None:
    """`errors:` names a type by its name, its module path or a base class's; a type's names are walked once and
    kept, the lists applied at each failure (two queues with different lists share the cache)."""
    from bridge.config.models import ErrorsConfig
    from bridge.engine.policy import classify

    exc = ConnectionRefusedError("no")
    by_base = ErrorsConfig(permanent=["OSError"])
    by_path = ErrorsConfig(retryable=["builtins.ConnectionError"], default="permanent")
    neither = ErrorsConfig(permanent=["KeyError"], default="retryable")
    for _ in range(2):  # the second time from the cache
        assert classify(exc, by_base) == Outcome.PERMANENT_FAILURE
        assert classify(exc, by_path) == Outcome.RETRYABLE_FAILURE
        assert classify(exc, neither) == Outcome.RETRYABLE_FAILURE
        assert classify(exc, ErrorsConfig(default="permanent")) == Outcome.PERMANENT_FAILURE
