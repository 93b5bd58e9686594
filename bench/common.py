"""Helpers shared by the benchmarks: machine description, RSS, percentiles, RESULTS.md."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
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
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = f"python -m {spec.name}" if spec else f"python {sys.argv[0]}"
    command = " ".join([program, *sys.argv[1:]])
    with RESULTS.open("a") as f:
        f.write(f"\n## {title} — {stamp}\n\n- machine: {machine()}\n- command: `{command}`\n\n")
        f.write("\n".join(f"    {line}" for line in lines) + "\n")
