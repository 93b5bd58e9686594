"""bridge/aio.py's OneThread: calls in order on one thread, errors handed back, a call its caller gave up on
before it ran is skipped, and a call that never returns cannot keep the process from exiting."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from bridge.aio import OneThread


async def test_calls_run_in_order_on_one_thread_and_errors_come_back() -> None:
    thread = OneThread("t")
    seen: list[tuple[int, int]] = []
    await asyncio.gather(*(thread.call(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(50)))
    assert [i for i, _ in seen] == list(range(50)) and len({ident for _, ident in seen}) == 1
    assert seen[0][1] != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        await thread.call(lambda: 1 / 0)
    assert await thread.call(lambda a, b=0: a + b, 2, b=3) == 5
    thread.shutdown(wait=True)


async def test_a_call_given_up_on_before_it_ran_is_skipped() -> None:
    thread = OneThread("t")
    gate, ran = threading.Event(), []
    first = asyncio.ensure_future(thread.call(gate.wait, 10))
    second = asyncio.ensure_future(thread.call(lambda: ran.append(1)))
    await asyncio.sleep(0.1)
    second.cancel()
    gate.set()
    assert await first is True
    assert await thread.call(lambda: "after") == "after"
    assert ran == []
    thread.shutdown(wait=True)


def test_a_call_that_never_returns_does_not_keep_the_process_from_exiting() -> None:
    script = """
import asyncio, time
from bridge.aio import OneThread

async def main():
    try:
        await asyncio.wait_for(OneThread("stuck").call(time.sleep, 3600), 0.2)
    except TimeoutError:
        print("abandoned", flush=True)

asyncio.run(main())
"""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "abandoned" in done.stdout, done.stderr
    assert time.monotonic() - began < 20
