"""The CPU time this process's cgroup allows it: a pod's CPU limit, in cores.

Kubernetes writes a container's `resources.limits.cpu` as a CFS quota: `cpu.max`
("150000 100000": 150 ms of CPU every 100 ms, 1.5 cores) under cgroup v2, or
`cpu.cfs_quota_us` / `cpu.cfs_period_us` under v1. The affinity mask still shows every core
of the node, so a rank that sizes its threads by the mask alone starts more threads than the
quota can run: they exhaust it early in each period and the whole cgroup then stalls until
the next one (a decode step that straddles the stall waits tens of milliseconds), and every
OpenMP barrier spins the quota away. The limit that binds is the smallest along the cgroup's
path to the root (a parent's quota caps its children).

Read once per rank by serve/threads.py's thread_plan, which sizes the rank's threads by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuQuota:
    cores: float  # quota / period: 1.5 for "150000 100000"
    source: str  # the file that set it, for the worker's report

    def __post_init__(self) -> None:
        if not self.cores > 0:
            raise ValueError(f"a CPU quota must be positive, got {self.cores}")

    def threads(self, ranks: int) -> int:
        """Threads for one of `ranks` ranks sharing the quota: its share, rounded up (a
        1.5-core pod runs two threads: the half core is worth having, and threads that
        yield lose nothing when the quota runs out)."""
        return max(1, math.ceil(self.cores / max(1, ranks) - 1e-9))

    def whole_threads(self, ranks: int) -> int:
        """The share rounded down (at least 1): what a rank's measured thread count starts
        at (runtime/core/thread_policy.py), and probes up from. Measured on 2 cores (AMD
        EPYC Zen 4), SmolLM2 bf16 TP=1 under a 1.5-core quota: one thread 61.7-78.3 tok/s at
        c=1, two 58.2-66.9 (a spent quota stops the whole team mid-region until the next
        period), and 193 against 184 at c=4."""
        return max(1, math.floor(self.cores / max(1, ranks) + 1e-9))

    def as_dict(self) -> dict[str, object]:
        return {"cores": round(self.cores, 3), "source": self.source}


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fs type, super options) of each cgroup mount in mountinfo
    (`id parent maj:min root mountpoint opts [optional...] - fstype source superopts`)."""
    out = []
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or not tail[0].startswith("cgroup"):
            continue
        out.append((fields[3], fields[4], tail[0], set(tail[2].split(","))))
    return out


def _levels(mount_root: str, mount_point: str, path: str, fs_root: Path) -> list[Path]:
    """The directories from this process's cgroup up to the mount's top. A container that
    bind-mounts its own cgroup shows it as the mount's root: the part below is what remains."""
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root):]
    top = fs_root / mount_point.lstrip("/")
    parts = [p for p in path.split("/") if p]
    return [top.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _level_quota(d: Path, v2: bool) -> float | None:
    if v2:
        raw = _read(d / "cpu.max")
        if raw is None:
            return None
        quota, _, period = raw.partition(" ")
        if quota == "max":
            return None
        return int(quota) / int(period or "100000")
    quota_us, period_us = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    if quota_us is None or period_us is None or int(quota_us) < 0:
        return None
    return int(quota_us) / int(period_us)


def cpu_quota(fs_root: Path = Path("/")) -> CpuQuota | None:
    """This process's CPU limit in cores, or None when none is set (or none can be read).
    `fs_root` stands for "/" in tests, which lay out /proc and /sys/fs/cgroup under it."""
    proc = fs_root / "proc/self"
    cgroups, mountinfo = _read(proc / "cgroup"), _read(proc / "mountinfo")
    if cgroups is None or mountinfo is None:
        return None
    v1_path = v2_path = None
    for line in cgroups.splitlines():  # "hierarchy-id:controllers:path"
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    best: CpuQuota | None = None
    for root, point, fstype, opts in _mounts(mountinfo):
        if fstype == "cgroup" and "cpu" in opts and v1_path is not None:
            v2, path = False, v1_path
        elif fstype == "cgroup2" and v2_path is not None:
            v2, path = True, v2_path
        else:
            continue
        for d in _levels(root, point, path, fs_root):
            try:
                cores = _level_quota(d, v2)
            except ValueError:  # a file we do not understand sets no limit
                continue
            if cores is not None and cores > 0 and (best is None or cores < best.cores):
                name = "cpu.max" if v2 else "cpu.cfs_quota_us"
                best = CpuQuota(cores, "/" + str((d / name).relative_to(fs_root)))
    return best
