"""A lane with `ordering: key` under a randomized mix (issue 25: ordered lanes take chunks; an async handler's
runners report a success as fetched), its handler sync or async: random keys (and records without one),
failures, slow records that start more runners, failures that hold the lane for a while, and the store
confirming each failure's task after a random delay — with real handler threads and the consumer's watchdog.
Whatever the mix:

- every record is reported exactly once, and the lane ends empty (backlog and bytes);
- no two records of a key run at once, and a key's records run in offset order;
- once a key's record failed, none of its later records runs: each is parked (a PARKED task), in this rig for
  good (the store never says the key is free).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from bridge.handler_api import HandlerContext
from bridge.model import Status
from bridge.records import Fetched, SourceRecord
from bridge.source.ends import Ran, Results
from bridge.source.lanes import Lane
from tests.helpers import eventually
from tests.test_lanes import Rig, offset_of, watchdog


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = Rig(tmp_path)
    yield r
    await r.close()


class Mix:
    """The seed's records and the handler that plays them: which fail, which are slow; what ran, by key."""

    def __init__(self, seed: int, n: int) -> None:
        rng = random.Random(seed)
        keys = rng.randint(1, 12)
        self.keys: list[bytes | None] = [None if rng.random() < 0.1 else bytes([rng.randrange(keys), 0xff])
                                         for _ in range(n)]
        self.fails = {i for i in range(n) if rng.random() < 0.04}
        self.slow = {i for i in range(n) if rng.random() < 0.05}
        self.ran: dict[bytes | None, list[int]] = {}
        self.overlaps: list[int] = []
        self._running: set[bytes] = set()
        self._lock = threading.Lock()

    def records(self) -> list[Fetched]:
        return [SourceRecord("t", 0, i, key, b"{}", None, ()).fetched() for i, key in enumerate(self.keys)]

    def __call__(self, ctx: HandlerContext) -> None:
        """The sync handler (a lane's chunked runners on handler threads)."""
        offset, key = self._began(ctx)
        try:
            if offset in self.slow:
                time.sleep(0.002)  # waits, as I/O does: three in a row start more runners
            if offset in self.fails:
                raise ConnectionError("down")
        finally:
            self._ended(key)

    async def run_async(self, ctx: HandlerContext) -> None:
        """The same as an async handler (the lane's runners are tasks on the loop)."""
        offset, key = self._began(ctx)
        try:
            if offset in self.slow:
                await asyncio.sleep(0.002)  # suspends: the lane's second runner takes the next record meanwhile
            if offset in self.fails:
                raise ConnectionError("down")
        finally:
            self._ended(key)

    def _began(self, ctx: HandlerContext) -> tuple[int, bytes | None]:
        offset = offset_of(ctx)
        key = self.keys[offset]
        with self._lock:
            if key is not None and key in self._running:
                self.overlaps.append(offset)
            if key is not None:
                self._running.add(key)
            self.ran.setdefault(key, []).append(offset)
        return offset, key

    def _ended(self, key: bytes | None) -> None:
        with self._lock:
            if key is not None:
                self._running.discard(key)


def confirm_later(lane: Lane, rng: random.Random, collect: Callable[[Lane, Results], None]) -> Callable[
        [Lane, Results], None]:
    """The consumer's side: results collected; each failure's key confirmed stored after a random delay (the
    group commit), as `Lane.stored` is called once the batch's tasks are in the store."""
    loop = asyncio.get_running_loop()

    def on_results(lane_: Lane, results: Results) -> None:
        collect(lane_, results)
        keys = [ran.record.key for ran in results.failures()]
        if keys:
            loop.call_later(rng.uniform(0, 0.02), lane.stored, keys)

    return on_results


def hold_sometimes(rng: random.Random) -> Callable[[Lane, Ran], None]:
    """A failure holds the lane now and then (max_open_tasks), released a little later."""
    loop = asyncio.get_running_loop()

    def release(lane: Lane) -> None:
        lane.held = False
        lane.dispatch()

    def on_failure(lane: Lane, ran: Ran) -> None:
        if rng.random() < 0.3:
            lane.held = True
            loop.call_soon_threadsafe(loop.call_later, rng.uniform(0.001, 0.02), release, lane)

    return on_failure


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("seed", range(12))
async def test_an_ordered_lanes_chunks_keep_every_key_in_order_whatever_the_mix(rig: Rig, seed: int,
                                                                               kind: str) -> None:
    n = 600
    mix = Mix(seed, n)
    rng = random.Random(seed * 7919)
    handler = mix if kind == "sync" else mix.run_async
    lane = await rig.lane(handler, limit=4, on_failure=hold_sometimes(rng), ordering="key")
    lane._on_results = confirm_later(lane, rng, lane._on_results)
    lane.load_keys(set())
    dog = asyncio.create_task(watchdog(lane))
    try:
        for start in range(0, n, 100):  # polls, as the consumer adds them
            lane.add(mix.records()[start:start + 100])
            await asyncio.sleep(rng.uniform(0, 0.01))
        done = await eventually(lambda: len(rig.results) >= n, within=20)
        await asyncio.sleep(0.1)  # nothing reported twice after the last
    finally:
        dog.cancel()
    by_offset: dict[int, Ran] = {}
    for ran in rig.results:
        assert ran.record.offset not in by_offset, f"seed {seed}: {ran.record.offset} reported twice"
        by_offset[ran.record.offset] = ran
    assert done and sorted(by_offset) == list(range(n)), f"seed {seed}: {n - len(by_offset)} never reported"
    assert mix.overlaps == [], f"seed {seed}: two of a key at once at {mix.overlaps}"
    assert lane.backlog == 0 and lane.ready_bytes == 0
    for key in set(mix.keys):
        offsets = [i for i, k in enumerate(mix.keys) if k == key]
        if key is None:
            assert sorted(mix.ran.get(None, [])) == offsets  # no key: each runs, once
            continue
        first_failure = next((i for i in offsets if i in mix.fails), None)
        expected = offsets if first_failure is None else [i for i in offsets if i <= first_failure]
        assert mix.ran.get(key, []) == expected, f"seed {seed}, key {key!r}: ran {mix.ran.get(key)}"
        for i in offsets:
            task = by_offset[i].task
            if first_failure is not None and i > first_failure:
                assert task is not None and task.status == Status.PARKED, f"seed {seed}: {i} not parked"
            elif i in mix.fails:
                assert task is not None and task.status != Status.PARKED
            else:
                assert task is None
