"""Which cores a rank runs on, settled in the supervisor before the worker starts.

Under a plain `mpirun -n N serve launch ...`, Open MPI binds each rank to ONE core when it
starts two ranks or fewer (its default policy; `--bind-to none` is what our own launcher
passes). A TP=1 rank on a 16-core host would then decode on one core. So a rank bound to
fewer cores than its even share of what its launcher may use takes that share (contiguous
cores, by local rank); a deliberate narrow binding stays with AOTLLM_KEEP_BINDING=1.

It has to happen before the worker's interpreter starts: GNU OpenMP reads the affinity
mask once at load and, seeing fewer cores than threads, sleeps in every barrier instead
of spinning. Measured on two cores, TP=1 served ITL: 21.7 ms bound to one core, 48 ms
widened from inside the worker, 12.5 ms widened before it (as `--bind-to none`).
No torch here: the supervisor stays light.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from runtime.env import BINDING, KEEP_BINDING, flag

KEEP_BINDING_ENV = KEEP_BINDING.name
BINDING_ENV = BINDING.name  # what the supervisor changed, for the worker to report


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."


def launcher_cores() -> set[int]:
    """The widest set of cores among this process's ancestors that holds its own: what
    mpirun (and whatever started it) may use, before it bound this rank."""
    own = os.sched_getaffinity(0)
    widest, cur = set(own), _parent(os.getpid())
    while cur and cur > 1:
        try:
            cores = os.sched_getaffinity(cur)
        except OSError:  # gone, or not ours to read
            break
        if cores >= own and len(cores) > len(widest):
            widest = set(cores)
        cur = _parent(cur)
    return widest


def rank_share(host: set[int], local_rank: int, local_size: int) -> set[int]:
    """Local rank `local_rank`'s even, contiguous share of `host`'s cores (at least one;
    more ranks than cores take them in turn)."""
    ordered = sorted(host)
    per = max(1, len(ordered) // max(1, local_size))
    start = local_rank * per % (len(ordered) - per + 1)
    return set(ordered[start:start + per])


def widen_binding(local_rank: int, local_size: int) -> dict[str, object] | None:
    """Take this rank's share of its launcher's cores when it was bound to fewer (every
    thread of this process moves: on Linux the mask is per thread); the change, or None."""
    if not hasattr(os, "sched_setaffinity") or flag(KEEP_BINDING):
        return None
    own, host = os.sched_getaffinity(0), launcher_cores()
    share = rank_share(host, local_rank, local_size)
    if len(own) >= len(share):
        return None
    try:
        for task in Path("/proc/self/task").iterdir():
            os.sched_setaffinity(int(task.name), share)
    except OSError as e:
        return {"from": sorted(own), "kept": True, "reason": str(e)}
    return {"from": sorted(own), "to": sorted(share),
            "why": f"mpirun bound this rank to {len(own)} of its {len(host)} "
                   f"cores; {KEEP_BINDING_ENV}=1 keeps such a binding"}


def widen_for_worker(env: dict[str, str]) -> None:
    """In the supervisor, before it starts the worker: widen, and tell the worker."""
    local_rank = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    local_size = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    change = widen_binding(local_rank, local_size)
    if change is not None:
        env[BINDING_ENV] = json.dumps(change)


def binding_change() -> dict[str, object] | None:
    """In the worker: what its supervisor changed, if anything."""
    raw = BINDING.raw()
    return json.loads(raw) if raw else None


def pin_compute_thread(local_rank: int, local_size: int) -> list[int] | None:
    """Several unbound ranks on one host: pin the calling thread (the one that runs the
    steps), and so the threads it starts later (OpenMP's), to this rank's share of the
    cores, leaving threads already started (HTTP) free to run wherever there is room.
    Two ranks' step threads that the scheduler puts on one core stall every collective
    of the step until it moves one:
    TP=2 on 2 cores, served c=1, three interleaved rounds: 60.0 / 52.2 / 60.2 tok/s and
    ITL p99 26-31 ms unpinned, 66.8 / 66.3 / 66.0 tok/s and 18-19 ms pinned (TP=1 in the
    same rounds: 71.6 / 71.4 / 68.4); c=16 unchanged (342-382 either way). The cores
    pinned, or None."""
    if local_size < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    host = launcher_cores()
    if os.sched_getaffinity(0) != host:  # bound by mpirun or by hand: leave it
        return None
    share = rank_share(host, local_rank, local_size)
    os.sched_setaffinity(0, share)  # this thread only, and the threads it starts later
    return sorted(share)
