"""A rank's intra-op threads, chosen for the cores it has (serve/cores.py chose those)."""

from __future__ import annotations

import os
import sys

import torch

from runtime.dist.comm import Comm
from runtime.env import THREADS, count
from serve.cores import binding_change, launcher_cores
from serve.cpu_quota import cpu_quota

# Python's default 5 ms: a thread that wants the GIL may wait that long. Rank 0's HTTP
# thread and engine thread hand the GIL back and forth at every token; a short interval
# keeps either from stalling the other (the step itself runs without the GIL).
GIL_SWITCH_INTERVAL_S = 0.0005


def thread_plan(comm: Comm) -> dict[str, object]:
    """Set and return the rank's threads: a rank that sees all of its launcher's cores
    (unbound) takes its even share of them, a bound rank as many as it is bound to
    (oversubscribing cores slows every collective and every OpenMP barrier); a cgroup CPU
    quota (a pod's limit) caps that at the rank's share of the quota, rounded up."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
        unbound = cores == len(launcher_cores())
        threads = cores // max(1, comm.local_size) if unbound else cores
    else:
        cores = threads = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        threads = min(threads, quota.threads(comm.local_size))
    chosen = count(THREADS)  # serve launch has checked it
    if chosen is not None:
        threads = chosen
    torch.set_num_threads(max(1, threads))
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    plan: dict[str, object] = {"cores": cores, "ranks_on_host": comm.local_size,
                               "intra_op_threads": torch.get_num_threads(),
                               "gil_switch_interval_s": sys.getswitchinterval()}
    if quota is not None:
        plan["cpu_quota"] = quota.as_dict()
    if chosen is not None:
        plan["from"] = THREADS.name
    change = binding_change()
    if change is not None:
        plan["binding"] = change
    return plan
