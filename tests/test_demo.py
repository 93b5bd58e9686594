"""`make demo` runs to completion (the README's first screen says to try it), on the test broker."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import KafkaEnv

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parent.parent


def test_make_demo_shows_retries_the_dlq_and_a_redrive_that_succeeds(kafka: KafkaEnv) -> None:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    proc = subprocess.run(["make", "-s", "demo"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for seen in ("ok        kafka://", "succeeded on attempt 1", "first delivery failed: TransientError",
                 "retry due in", "succeeded on attempt 3", "DEAD after 3 attempt(s)", "published to the DLQ",
                 "DEAD after 1 attempt(s): bridge.handler_api.Permanent", "$ rdq stats", "$ rdq get",
                 "$ rdq dlq tail", "$ rdq set-policy demo.flaky --set max_attempts=5", "$ rdq redrive --task",
                 "SUCCEEDED after its redrive", "bridge stopped"):
        assert seen in out, f"{seen!r} not in the demo's output:\n{out}"
