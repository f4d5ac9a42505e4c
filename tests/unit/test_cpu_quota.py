"""A pod's CPU limit (serve/cpu_quota.py): read from cgroup v1 or v2, the smallest along the
path, and the rank's threads capped by it (serve/threads.py). The last tests put a real
process in a real cgroup v1 with a real CFS quota, as a pod limit does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.servers import CPU_V1, cpu_quota_cgroup
from serve.cpu_quota import CpuQuota, cpu_quota
from tests.conftest import REPO, subprocess_env

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 {root} /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTS = "29 23 0:26 {root} /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def _fs(tmp: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    (tmp / "proc/self").mkdir(parents=True)
    (tmp / "proc/self/cgroup").write_text(cgroup)
    (tmp / "proc/self/mountinfo").write_text(mountinfo)
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text + "\n")
    return tmp


def test_no_limit_reads_as_none(tmp_path: Path) -> None:
    fs = _fs(tmp_path, "2:cpuacct:/\n1:cpu:/\n0::/\n", V1_MOUNTS.format(root="/"),
             {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1",
              "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
              "sys/fs/cgroup/unified/cpu.max": "max 100000"})
    assert cpu_quota(fs) is None


def test_v1_quota_is_the_smallest_along_the_path(tmp_path: Path) -> None:
    base = "sys/fs/cgroup/cpu"
    fs = _fs(tmp_path, "2:cpuacct:/\n1:cpu:/kubepods/pod1/c1\n0::/\n", V1_MOUNTS.format(root="/"),
             {f"{base}/cpu.cfs_quota_us": "-1", f"{base}/cpu.cfs_period_us": "100000",
              f"{base}/kubepods/pod1/cpu.cfs_quota_us": "300000",
              f"{base}/kubepods/pod1/cpu.cfs_period_us": "100000",
              f"{base}/kubepods/pod1/c1/cpu.cfs_quota_us": "75000",
              f"{base}/kubepods/pod1/c1/cpu.cfs_period_us": "50000"})
    q = cpu_quota(fs)
    assert q == CpuQuota(1.5, "/sys/fs/cgroup/cpu/kubepods/pod1/c1/cpu.cfs_quota_us")
    # A parent tighter than the child binds.
    (fs / f"{base}/kubepods/pod1/cpu.cfs_quota_us").write_text("50000\n")
    assert cpu_quota(fs) == CpuQuota(0.5, "/sys/fs/cgroup/cpu/kubepods/pod1/cpu.cfs_quota_us")


def test_v2_cpu_max_and_a_container_that_mounts_its_own_cgroup(tmp_path: Path) -> None:
    # Docker without a cgroup namespace: /proc/self/cgroup names the host path, and the
    # container's /sys/fs/cgroup is that very directory (the mount's root).
    fs = _fs(tmp_path, "0::/system.slice/docker-abc.scope\n",
             V2_MOUNTS.format(root="/system.slice/docker-abc.scope"),
             {"sys/fs/cgroup/cpu.max": "250000 100000"})
    assert cpu_quota(fs) == CpuQuota(2.5, "/sys/fs/cgroup/cpu.max")
    (fs / "sys/fs/cgroup/cpu.max").write_text("max 100000\n")
    assert cpu_quota(fs) is None


def test_unreadable_or_odd_files_set_no_limit(tmp_path: Path) -> None:
    fs = _fs(tmp_path, "0::/a\n", V2_MOUNTS.format(root="/"),
             {"sys/fs/cgroup/a/cpu.max": "lots 100000"})
    assert cpu_quota(fs) is None
    assert cpu_quota(tmp_path / "nowhere") is None


def test_threads_are_the_ranks_share_rounded_up() -> None:
    assert CpuQuota(1.5, "x").threads(1) == 2
    assert CpuQuota(1.5, "x").threads(2) == 1
    assert CpuQuota(2.0, "x").threads(1) == 2
    assert CpuQuota(4.0, "x").threads(2) == 2
    assert CpuQuota(0.2, "x").threads(4) == 1
    # Rounded down: where a single rank's measured count starts (serve/backends/torch.py).
    assert CpuQuota(1.5, "x").whole_threads(1) == 1
    assert CpuQuota(2.0, "x").whole_threads(1) == 2
    assert CpuQuota(2.7, "x").whole_threads(1) == 2
    assert CpuQuota(0.5, "x").whole_threads(1) == 1
    with pytest.raises(ValueError, match="positive"):
        CpuQuota(0.0, "x")


PLAN = ("import json; from types import SimpleNamespace; from serve.threads import thread_plan;"
        "print(json.dumps(thread_plan(SimpleNamespace(local_size={n}))))")


@pytest.mark.parametrize(("cores", "ranks", "threads"), [(1.5, 1, 2), (0.5, 1, 1), (1.5, 2, 1)])
def test_a_rank_in_a_real_quota_runs_its_share_of_threads(
        cores: float, ranks: int, threads: int) -> None:
    # The real cgroup v1 with a CFS quota that the bench puts servers in, removed afterwards.
    if not (CPU_V1 / "cpu.cfs_quota_us").exists():
        pytest.skip("no cgroup v1 cpu controller on this machine (DEVELOPERS.md: it is there)")
    with cpu_quota_cgroup(cores, "test") as prefix:
        done = subprocess.run([*prefix, sys.executable, "-c", PLAN.format(n=ranks)],
                              cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout.splitlines()[-1])
    assert plan["cpu_quota"]["cores"] == cores
    assert plan["cpu_quota"]["source"].endswith("cpu.cfs_quota_us")
    expected = min(threads, len(os.sched_getaffinity(0)) // ranks or 1)
    assert plan["intra_op_threads"] == expected
