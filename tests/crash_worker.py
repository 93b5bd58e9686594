"""A process that stores and completes tasks as fast as it can, printing a line for every acknowledged write.

Run by tests/test_crash.py, which SIGKILLs it at random moments and then checks that every acknowledged write
survived. Lines: `S <id>` (submit acknowledged), `D <id> <status> <attempt_no>` (an outcome acknowledged),
`J <partition> <hi>` (an in-flight journal write acknowledged: not fsync'd alone, it must survive the kill too).
"""

from __future__ import annotations

import asyncio
import random
import sys

from bridge.clock import SystemClock
from bridge.model import Attempt, ErrorInfo, NewTask, Outcome, Status
from bridge.store.results import RunReport
from bridge.store.tasks import Store


def ack(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def submitter(store: Store, clock: SystemClock, rng: random.Random) -> None:
    while True:
        now = clock.now_ms()
        dead = rng.random() < 0.1
        error = ErrorInfo("E", "first delivery")
        task = NewTask("q", "h", rng.randbytes(rng.randint(0, 2000)), {"rdq.source": f"kafka://t/0/{rng.getrandbits(60)}"},
                       Status.DEAD if dead else Status.PENDING, now,
                       Attempt(1, 0, now, now, Outcome.RETRYABLE_FAILURE, error, "c"),
                       None if dead else now, error if dead else None)
        ack(f"S {await store.submit(task)}")


async def worker(store: Store, clock: SystemClock, rng: random.Random, name: str) -> None:
    while True:
        tasks = await store.claim_due("q", 5, 0.5, name, clock.now_ms())
        if not tasks:
            await asyncio.sleep(0.005)
        for task in tasks:
            now = clock.now_ms()
            roll = rng.random()
            if roll < 0.5:
                r = await store.record_success(task.id, task.lease_token, task.attempt_count,
                                               RunReport(now, now, Outcome.SUCCESS, None, name))
            elif roll < 0.8 and task.attempt_count < 4:
                r = await store.record_retry(task.id, task.lease_token, RunReport(
                    now, now, Outcome.RETRYABLE_FAILURE, ErrorInfo("E", "again"), name), now)
            else:
                r = await store.record_dead(task.id, task.lease_token, RunReport(
                    now, now, Outcome.PERMANENT_FAILURE, ErrorInfo("P", "no"), name), ErrorInfo("P", "no"))
            if r.accepted:
                ack(f"D {task.id} {r.status} {r.attempt_no}")


async def journaler(store: Store, clock: SystemClock, rng: random.Random, run_id: str) -> None:
    """The consumer's in-flight journal: a poll's range a partition, written with `durable=False` (a group commit
    of journal writes alone is not fsync'd), sometimes sharing its commit with the submitters' durable ones."""
    hi = 0
    while True:
        partition = rng.randrange(4)
        hi += rng.randint(1, 50)
        await store.journal_inflight(run_id, [("t", partition, hi - 10, hi)], [], clock.now_ms())
        ack(f"J {partition} {hi}")
        await asyncio.sleep(rng.uniform(0, 0.004))


async def reclaimer(store: Store, clock: SystemClock) -> None:
    """Leases left by a killed predecessor lapse; give them back (as the sweep would)."""
    while True:
        now = clock.now_ms()
        for row in await store.lapsed_leases(now):
            await store.expire_lease(row, now, now if row["attempt_count"] < 4 else None)
        await asyncio.sleep(0.05)


async def main(path: str, seed: int) -> None:
    store = await Store.open(path)
    clock = SystemClock()
    rng = random.Random(seed)
    synchronous = await store.db.in_thread(lambda: store.db.conn.execute("PRAGMA synchronous").fetchone()[0])
    ack(f"READY synchronous={synchronous}")  # 2 = FULL, the production default
    await asyncio.gather(*(submitter(store, clock, random.Random(rng.random())) for _ in range(8)),
                         *(worker(store, clock, random.Random(rng.random()), f"w{i}") for i in range(3)),
                         journaler(store, clock, random.Random(rng.random()), f"run-{seed}"),
                         reclaimer(store, clock))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
