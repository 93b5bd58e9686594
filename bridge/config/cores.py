"""How many cores this process may use: its CPU affinity, lowered by a cgroup's CPU quota (a Kubernetes pod's
`resources.limits.cpu`, Docker's `--cpus`). A pod limited to 2 CPUs on a 32-core node sees 32 cores through its
affinity; `engine.processes: auto` and the changelog's helper process (`core_to_spare`) must count 2.

A quota of 1.5 CPUs counts as 2 (rounded up, as the JVM and Go's runtime count a container's CPUs): the half core
is usable, and a bridge process is mostly one busy thread. Both cgroup versions are read:

- v2: `cpu.max` ("<quota> <period>" or "max <period>") of the process's cgroup and of each parent up to the mount;
- v1: `cpu.cfs_quota_us` and `cpu.cfs_period_us` (quota -1: none) of the `cpu` hierarchy, likewise.

Inside a container the cgroup path in /proc/self/cgroup may be the host's while the mount shows only the
container's own cgroup at its root: every directory from the path's to the mount's root is tried, and the
smallest limit found wins. An unreadable or odd file is no limit (the affinity stands).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

CGROUP_MOUNT = Path("/sys/fs/cgroup")


def cores(proc_self: Path = Path("/proc/self"), cgroup_mount: Path = CGROUP_MOUNT) -> int:
    """The cores this process may run on: its affinity, or its cgroup's CPU quota rounded up when lower."""
    try:
        available = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    quota = cgroup_cpu_quota(proc_self, cgroup_mount)
    return available if quota is None else max(1, min(available, math.ceil(quota)))


def cgroup_cpu_quota(proc_self: Path, cgroup_mount: Path) -> float | None:
    """The smallest CPU quota (in CPUs) over this process's cgroups, v1 and v2; None when there is none."""
    try:
        lines = (proc_self / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            limits += _limits(cgroup_mount, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in (cgroup_mount / controllers, cgroup_mount / "cpu", cgroup_mount / "cpu,cpuacct"):
                limits += _limits(mount, path, _v1_quota)
    return min(limits) if limits else None


def _limits(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """Each limit found in the directories from `path` (under `mount`) up to `mount` itself."""
    found = []
    parts = [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        limit = read(mount.joinpath(*parts[:depth]))
        if limit is not None:
            found.append(limit)
    return found


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
        return None if quota == "max" else _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return _ratio(quota, period)


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None
