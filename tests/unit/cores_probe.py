"""Run under mpirun: what serve/supervisor.py does before it starts the worker (widen the
rank's binding), then a child interpreter, as the worker, reports its cores and threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    from types import SimpleNamespace

    from serve.threads import thread_plan

    plan = thread_plan(SimpleNamespace(local_size=int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])))
    print(json.dumps({"cores": sorted(os.sched_getaffinity(0)), "plan": plan}))
elif __name__ == "__main__":
    from serve.cores import widen_for_worker

    bound = sorted(os.sched_getaffinity(0))
    env = dict(os.environ)
    widen_for_worker(env)
    out = subprocess.run([sys.executable, __file__, "worker"], env=env, capture_output=True,
                         text=True, check=True).stdout
    print(json.dumps({"rank": int(os.environ["OMPI_COMM_WORLD_RANK"]), "bound": bound,
                      **json.loads(out)}))
