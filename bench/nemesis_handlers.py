"""The handler of the randomized whole-system run (bench/nemesis.py), loaded by its bridges from
`engine.handler_modules`. What a record does is in its payload, `{"kind": …}`:

- `ok`: succeeds; `transient` (`"fail": N`): its first N attempts fail retryably, then it succeeds;
- `permanent`: always fails permanently (one DLQ record);
- `crash`: SIGKILLs the bridge running it, every time (a poison pill: it must still reach the DLQ);
- `hang` (`"ms": M`): its first attempt blocks M ms without a heartbeat (past its lease), later ones succeed;
- `fixable`: fails permanently until the file NEMESIS_FIXED names exists (the fix is deployed), then succeeds —
  the nemesis redrives the ones that died before.

Each success appends one JSON line to RDQ_EXAMPLE_LOG: source, attempt, redrive count and the time.
"""

from __future__ import annotations

import json
import os
import signal
import time

from bridge.handler_api import HandlerContext, Permanent
from bridge.registry import handler
from handlers.examples import append_example_log


class NotDeployed(Exception):
    """The fix is not deployed yet (the queue's config lists it as permanent): redriven once it is."""


@handler("chaos")
def chaos(ctx: HandlerContext) -> None:
    payload = json.loads(ctx.payload)
    kind = payload["kind"]
    if kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "permanent":
        raise Permanent("nemesis: this record can never succeed")
    if kind == "fixable" and not os.path.exists(os.environ.get("NEMESIS_FIXED", "/nonexistent")):
        raise NotDeployed("nemesis: the fix is not deployed yet")
    if kind == "transient" and ctx.attempt <= int(payload.get("fail", 1)):
        raise ConnectionError(f"nemesis: attempt {ctx.attempt} fails")
    if kind == "hang" and ctx.attempt == 1:
        time.sleep(float(payload.get("ms", 3000)) / 1000)
    append_example_log({"handler": "chaos", "source": ctx.source, "attempt": ctx.attempt,
                        "redrive": ctx.redrive_count, "kind": kind, "t": time.time()})
