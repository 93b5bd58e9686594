"""`cores()`: the CPU affinity, lowered by a cgroup's CPU quota (v1 or v2), read from a fake /proc and
/sys/fs/cgroup laid out as a container or a host shows them."""

from __future__ import annotations

import os
from pathlib import Path

from bridge.config.cores import cgroup_cpu_quota, cores

AFFINITY = len(os.sched_getaffinity(0))


def _layout(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, mount = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    (proc / "cgroup").write_text(proc_cgroup)
    for name, text in files.items():
        (mount / name).parent.mkdir(parents=True, exist_ok=True)
        (mount / name).write_text(text)
    return proc, mount


def test_a_v2_quota_of_one_and_a_half_cpus_counts_two(tmp_path: Path) -> None:
    proc, mount = _layout(tmp_path, "0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/cpu.max": "150000 100000\n"})
    assert cgroup_cpu_quota(proc, mount) == 1.5
    assert cores(proc, mount) == min(AFFINITY, 2)


def test_a_v2_parent_limit_binds_its_children_and_max_is_none(tmp_path: Path) -> None:
    proc, mount = _layout(tmp_path, "0::/kubepods/pod1/c1\n", {
        "kubepods/pod1/c1/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "100000 100000\n"})
    assert cgroup_cpu_quota(proc, mount) == 1.0
    assert cores(proc, mount) == 1


def test_a_container_sees_its_own_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path; the container's mount holds only its own cgroup, at the root.
    proc, mount = _layout(tmp_path, "0::/system.slice/docker-abc.scope\n", {"cpu.max": "50000 100000\n"})
    assert cgroup_cpu_quota(proc, mount) == 0.5
    assert cores(proc, mount) == 1  # half a core is still one process's worth


def test_a_v1_quota_in_the_cpu_hierarchy(tmp_path: Path) -> None:
    proc, mount = _layout(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(proc, mount) == 3.0
    assert cores(proc, mount) == min(AFFINITY, 3)


def test_no_quota_leaves_the_affinity(tmp_path: Path) -> None:
    # As this machine shows it: v1 with quota -1, a v2 root with no cpu.max, a cgroup file of another host path.
    proc, mount = _layout(tmp_path, "1:cpu:/\n0::/\n", {
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n", "unified/cgroup.procs": ""})
    assert cgroup_cpu_quota(proc, mount) is None
    assert cores(proc, mount) == AFFINITY


def test_odd_or_missing_files_are_no_limit(tmp_path: Path) -> None:
    proc, mount = _layout(tmp_path, "0::/a\nnot a line\n", {"a/cpu.max": "garbage\n", "cpu.max": "0 100000\n"})
    assert cgroup_cpu_quota(proc, mount) is None
    assert cgroup_cpu_quota(tmp_path / "no-proc", mount) is None
    assert cores(tmp_path / "no-proc", mount) == AFFINITY
