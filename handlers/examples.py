"""The example handlers of SPEC §8.0: ok, flaky, permanent, sleep, crash.

When RDQ_EXAMPLE_LOG names a file, each success of `ok`/`flaky` appends one JSON line
{"handler", "source", "attempt"} so tests can count side effects from outside the process. `flaky` reads
`{"fail": N, "ms": M}` from a JSON payload: its first N attempts fail (retryable), the next sleeps M ms and succeeds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

from bridge.handler_api import HandlerContext, Permanent
from bridge.registry import handler


def _json_payload(ctx: HandlerContext) -> dict[str, Any]:
    try:
        data = json.loads(ctx.payload) if ctx.payload else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise Permanent(f"payload is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise Permanent("payload must be a JSON object")
    return data


def append_example_log(entry: dict[str, Any]) -> None:
    """One JSON line to RDQ_EXAMPLE_LOG, when it names a file (tests count side effects with it)."""
    path = os.environ.get("RDQ_EXAMPLE_LOG")
    if not path:
        return
    # One O_APPEND write per line: lines from concurrent threads and processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def record_success(name: str, ctx: HandlerContext) -> None:
    append_example_log({"handler": name, "source": ctx.source, "attempt": ctx.attempt})


class TransientError(Exception):
    """A retryable failure (the default classification)."""


@handler("ok")
def ok(ctx: HandlerContext) -> None:
    record_success("ok", ctx)


@handler("flaky")
def flaky(ctx: HandlerContext) -> None:
    payload = _json_payload(ctx)
    fail = int(payload.get("fail", 0))
    if ctx.attempt <= fail:
        raise TransientError(f"flaky: attempt {ctx.attempt} of the first {fail} fails")
    # A slow success ({"ms": N} on the succeeding attempt), without heartbeats: it runs within its lease.
    time.sleep(float(payload.get("ms", 0)) / 1000.0)
    record_success("flaky", ctx)


@handler("permanent")
def permanent(ctx: HandlerContext) -> None:
    raise Permanent("permanent: this handler always fails permanently")


@handler("sleep")
async def sleep(ctx: HandlerContext) -> None:
    remaining = float(_json_payload(ctx).get("ms", 0)) / 1000.0
    while remaining > 0:
        step = min(remaining, 0.5)
        await asyncio.sleep(step)
        remaining -= step
        ctx.heartbeat()


@handler("crash")
def crash(ctx: HandlerContext) -> None:
    # Abrupt end, as an OOM kill would do: no cleanup, no outcome recorded.
    os.kill(os.getpid(), signal.SIGKILL)
