"""Helpers shared by the benchmarks: machine description, RSS, percentiles, RESULTS.md."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
# Set by the smoke run (tests/test_benches.py: every bench once at a tiny size): print, do not record.
SMOKE = os.environ.get("RDQ_BENCH_SMOKE") == "1"
# Every first attempt of a store-path bench fails by design; the circuit breaker (on by default) would take that
# for an outage and hold the queue, and the bench would wait for ever. Those benches say they turn it off.
NO_BREAKER = {"breaker": {"enabled": False}}
NO_BREAKER_NOTE = "circuit breaker off (every first attempt fails by design: a breaker would hold it as an outage)"


class BenchTimeout(RuntimeError):
    """A bench that does not finish is a failed bench: it ends with this, saying what it waited for."""


def rss_mib(pid: int | str = "self", peak: bool = False) -> float:
    """The resident memory of this process, or of `pid` (0 when it is gone); `peak`: its highest so far (VmHWM)."""
    field = "VmHWM:" if peak else "VmRSS:"
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    system = f"{platform.system()} {platform.machine()}"
    return f"{system}, {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def record(title: str, lines: list[str]) -> None:
    """Print the figures and append them, with the machine and command, to bench/RESULTS.md."""
    text = "\n".join(lines)
    print(text)
    if SMOKE:
        print(f"(smoke run: {title!r} not recorded in {RESULTS.name})")
        return
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = f"python -m {spec.name}" if spec else f"python {sys.argv[0]}"
    command = " ".join([program, *sys.argv[1:]])
    with RESULTS.open("a") as f:
        f.write(f"\n## {title} — {stamp}\n\n- machine: {machine()}\n- command: `{command}`\n\n")
        f.write("\n".join(f"    {line}" for line in lines) + "\n")
