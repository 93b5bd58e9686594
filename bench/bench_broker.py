"""Local broker start-up: cold (empty jar cache and, optionally, empty Maven repository) and warm, plus RSS.

    python -m bench.bench_broker [--cold-maven]

Cold uses a fresh RDQ_KAFKA_CACHE (and with --cold-maven a fresh Maven local repository, i.e. every jar from
Maven Central); warm starts a second broker from the cache the cold run filled.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench.common import record
from localkafka import LocalBroker, resolve_jars


def timed_start(workdir: Path) -> tuple[float, float, LocalBroker]:
    began = time.monotonic()
    broker = LocalBroker(workdir).start()
    elapsed = time.monotonic() - began
    time.sleep(5)  # let the broker settle before reading its memory
    return elapsed, broker.rss_bytes() / 2**20, broker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cold-maven", action="store_true", help="also empty the Maven local repository")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["RDQ_KAFKA_CACHE"] = str(Path(tmp) / "cache")
        if args.cold_maven:
            os.environ["MAVEN_OPTS"] = f"-Dmaven.repo.local={Path(tmp) / 'm2'}"
        began = time.monotonic()
        resolve_jars()
        resolve_s = time.monotonic() - began
        cold, cold_rss, broker = timed_start(Path(tmp) / "b1")
        broker.stop()
        warm, warm_rss, broker = timed_start(Path(tmp) / "b2")
        broker.stop()
    what = "empty jar cache and empty Maven repository" if args.cold_maven else "empty jar cache, warm ~/.m2"
    record("local Kafka broker start-up", [
        f"cold ({what}): resolve {resolve_s:.1f} s + format and start {cold:.1f} s = {resolve_s + cold:.1f} s",
        f"warm (jars cached): format and start {warm:.1f} s",
        f"broker RSS 5 s after start: {cold_rss:.0f} MiB (cold run), {warm_rss:.0f} MiB (warm run); heap -Xmx512m",
    ])


if __name__ == "__main__":
    main()
