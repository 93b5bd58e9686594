"""The sidecar's cost at a rate teams run it at (issue 25): records that succeed, paced at 400 a second.

At full speed a record costs the bridge ~10 us of CPU; at a few hundred a second every poll holds one record, so
every per-poll step (a hop to the consumer thread and back, the in-flight journal's commit, a lane's hand-off, the
results' wake-up) is paid by each record. This bench prints what a record costs there: the CPU of the process
running the bridge (the paced producer runs in a process of its own) and its store commits, fsync'd or not;
baseline, the same run: a plain confluent-kafka loop that polls one record at a time (as a user's low-latency
loop does), runs the same handler and stores its offset, at the same pace.

    python -m bench.bench_lowrate [--n 4000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import tempfile
import time
from pathlib import Path

from bench.bench_kafka import (
    PARTITIONS,
    REGISTRY,
    Finished,
    _spread,
    bare_consumer,
    bench_config,
    broker,
    counted_ok,
    produce_paced,
    run_bridge_until,
)
from bench.common import record, rss_mib
from bridge.handler_api import HandlerContext
from bridge.kafka_clients import ensure_topics
from bridge.memory import tune_gc
from bridge.service import Bridge

RATE = 400  # records a second


def paced_producer(bootstrap: str, topic: str, n: int) -> multiprocessing.process.BaseProcess:
    """The records, produced at RATE a second from a process of its own: its CPU is not the measured one's."""
    process = multiprocessing.get_context("spawn").Process(target=produce_paced, args=(bootstrap, topic, n, RATE),
                                                           daemon=True)
    process.start()
    return process


class Paced:
    """This process's CPU and the bridge's store commits from the first record produced to the n-th finished."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.commits = self.synced = 0

    def start(self, bridge: Bridge | None = None) -> None:
        self.cpu, self.wall = time.process_time(), time.monotonic()
        self.commits, self.synced = _commits(bridge)

    def end(self, n: int, bridge: Bridge | None = None) -> tuple[float, float, float, float]:
        """(ms of CPU a record, cores busy, commits a record, fsync'd commits a record)."""
        cpu, wall = time.process_time() - self.cpu, time.monotonic() - self.wall
        commits, synced = _commits(bridge)
        return cpu / n * 1000, cpu / wall, (commits - self.commits) / n, (synced - self.synced) / n


def _commits(bridge: Bridge | None) -> tuple[int, int]:
    """The bridge's store commits so far, and of them the fsync'd ones (none for the baseline: it has no store)."""
    return (0, 0) if bridge is None else (bridge.store.stats.batches, bridge.store.stats.synced)


def bare_paced(bootstrap: str, topic: str, n: int) -> float:
    """The baseline: poll a record at a time, run the handler, store its offset (auto-commit). Its CPU a record,
    ms, from the first record produced to the n-th handled."""
    ok = REGISTRY.get("ok")
    assert ok is not None
    consumer = bare_consumer(bootstrap, "bare-paced")
    consumer.subscribe([topic])
    while not consumer.assignment():
        consumer.poll(0.1)
    time.sleep(1.0)  # as the bridge: its partitions fetched from before the first record comes
    paced = Paced()
    paced.start()
    producer = paced_producer(bootstrap, topic, n)
    seen = 0
    while seen < n:
        msg = consumer.poll(0.5)
        if msg is None or msg.error() is not None:
            continue
        source = f"kafka://{msg.topic()}/{msg.partition()}/{msg.offset()}"
        ok.fn(HandlerContext("t", "q", 1, 0, msg.value(), "application/json", {"rdq.source": source}))
        consumer.store_offsets(message=msg)
        seen += 1
    cpu_ms, _, _, _ = paced.end(n)
    producer.join(30)
    consumer.close()
    return cpu_ms


async def bridge_paced(bootstrap: str, tmp: Path, n: int) -> tuple[float, float, float, float]:
    """The bridge (production defaults, changelog on) on the same pace: `Paced.end`'s figures."""
    config = bench_config(bootstrap, tmp, {"handler": "ok"})
    topic = config.queues["q"].sources[0]
    ensure_topics(config)
    finished = Finished(n)
    paced = Paced()
    producer: list[multiprocessing.process.BaseProcess] = []
    ready: list[float] = []
    figures: list[tuple[float, float, float, float]] = []

    async def all_finished(bridge: Bridge) -> bool:
        if not producer:
            if not ready and all(bridge.consumer.owns(topic, p) for p in range(PARTITIONS)):
                ready.append(time.monotonic())
            if ready and time.monotonic() - ready[0] >= 1.0:  # as e2e: steady state, not a burst after joining
                paced.start(bridge)
                producer.append(paced_producer(bootstrap, topic, n))
            return False
        if finished.last is None:
            return False
        figures.append(paced.end(n, bridge))
        return True

    await run_bridge_until(config, all_finished, counted_ok(finished, "sync"))
    producer[0].join(30)
    return figures[0]


async def bench_lowrate(bootstrap: str, n: int, runs: int) -> None:
    bridge_cpu, cores, commits, synced, bare_cpu, rss = [], [], [], [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            config = bench_config(bootstrap, Path(tmp), {"handler": "ok"})
            ensure_topics(config)
            bare_cpu.append(await asyncio.to_thread(bare_paced, bootstrap, config.queues["q"].sources[0], n))
            cpu, busy, per_record, fsynced = await bridge_paced(bootstrap, Path(tmp), n)
        bridge_cpu.append(cpu)
        cores.append(busy)
        commits.append(per_record)
        synced.append(fsynced)
        rss.append(rss_mib())
    record("the sidecar's cost at 400 records/s (records that succeed)", [
        f"records: {n} at {RATE}/s, each succeeding on its first delivery (the `ok` handler), {PARTITIONS} "
        f"partitions; {runs} runs, each: the baseline, then the bridge (production defaults, changelog on); the "
        "producer in a process of its own",
        f"the bridge's process, CPU a record, min/median/max: {_spread(bridge_cpu, '.3f')} ms "
        f"({_spread(cores, '.2f')} of a core)",
        f"its store commits a record: {_spread(commits, '.2f')}; of them fsync'd: {_spread(synced, '.2f')}",
        f"baseline, a plain loop polling a record at a time (same handler, store_offsets): "
        f"{_spread(bare_cpu, '.3f')} ms a record",
        f"RSS of the bench process after each run: {', '.join(f'{r:.0f}' for r in rss)} MiB",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4000, help=f"records a run, produced at {RATE}/s")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (min/median/max reported)")
    args = parser.parse_args()
    tune_gc()
    with broker() as bootstrap:
        asyncio.run(bench_lowrate(bootstrap, args.n, args.runs))


if __name__ == "__main__":
    main()
