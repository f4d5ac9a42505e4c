"""Paths and small helpers shared by the benchmark scripts."""

from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from runtime.env import BENCH_HF_DIR, cache_root

REPO = Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
RESULTS = REPO / "bench" / "results"


def cache_dir() -> Path:
    """The folder outside the repo that holds the peers (see bench/peers.sh)."""
    return cache_root() / "peers"


def forced_isa() -> str | None:
    """The ISA level below the host's own that AOTLLM_CPU_ISA holds this run to, or None.

    `AOTLLM_CPU_ISA=avx2 python -m bench.run ...` measures that level on a richer host: our
    engines are built for it and served under it (runtime/host.py), and llama-server is the
    build for it (`bash bench/peers.sh llama-avx2`), so both sides run the same ISA."""
    from contract.target import cpu_isa_level
    from runtime.host import cpu_flags, host_cpu_target

    level = host_cpu_target().isa
    return level if level != cpu_isa_level(cpu_flags()) else None


def llama_peer() -> str:
    """The peers.sh step (and status name) of the llama-server this run serves."""
    level = forced_isa()
    return f"llama-{level}" if level else "llama"


def llama_server_bin() -> Path:
    """llama-server for the run's ISA level: the native build, or llama-build-LEVEL."""
    return cache_dir() / llama_peer().replace("llama", "llama-build", 1) / "bin" / "llama-server"


def vllm_python() -> Path:
    return cache_dir() / "vllm-venv" / "bin" / "python"


def peer_status(name: str) -> str:
    """The one-line status bench/peers.sh recorded for a peer ('ok ...', 'failed: ...')."""
    path = cache_dir() / "status" / f"{name}.txt"
    return path.read_text().strip() if path.exists() else "not installed (run make bench-peers)"


def demo_checkpoint() -> Path:
    """The demo Hugging Face checkpoint: $BENCH_HF_DIR, else `python -m demo.model`."""
    env = BENCH_HF_DIR.raw()
    if env:
        return Path(env)
    out = subprocess.run(
        [str(VENV_PYTHON), "-m", "demo.model"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"python -m demo.model failed: {out.stderr.strip()[-500:]}")
    path = Path(lines[-1].strip())
    if not (path / "config.json").exists():
        raise RuntimeError(f"demo.model printed {path}, which has no config.json")
    return path


def gemma3_gguf() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF from the wheels, by `python -m demo.model --model gemma3
    --gguf` (bench and demo are both entry points: one does not import the other)."""
    p = subprocess.run([str(VENV_PYTHON), "-m", "demo.model", "--model", "gemma3", "--gguf"],
                       cwd=REPO, capture_output=True, text=True, check=False)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        raise RuntimeError(f"python -m demo.model --model gemma3 --gguf failed: "
                           f"{p.stderr.strip()[-300:]}")
    return Path(lines[-1])


def gguf_for(hf_dir: Path) -> Path:
    return cache_dir() / "gguf" / f"{hf_dir.name}-bf16.gguf"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine_info() -> dict[str, str]:
    """What the report needs to say about the machine."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": mem,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "ISA level": (f"{forced_isa()} (forced by AOTLLM_CPU_ISA; llama-server built for it)"
                      if forced_isa() else "the host's own (native builds)"),
    }


def loadavg() -> str:
    """The 1/5/15-minute load averages: other work on the machine skews every number."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def session_stats(sid: int) -> dict[int, list[str]]:
    """pid -> /proc/<pid>/stat fields from field 3 on, for every process in session `sid`
    and every descendant of those processes.

    A server started with start_new_session=True is the leader of its own session; mpirun's
    ranks may sit in process groups of their own but stay in that session, and our serving
    workers are their children in sessions of their own (see serve/supervisor.py).
    """
    stats: dict[int, list[str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stats[int(proc.name)] = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
    # rest[0] is field 3 (state), rest[1] the parent (field 4), rest[3] the session (field 6)
    members = {pid for pid, rest in stats.items() if int(rest[3]) == sid}
    grew = True
    while grew:
        children = {pid for pid, rest in stats.items() if int(rest[1]) in members} - members
        members |= children
        grew = bool(children)
    return {pid: stats[pid] for pid in members}


def cpu_snapshot(sid: int) -> tuple[float, float]:
    """(CPU seconds busy on the whole machine, CPU seconds of session `sid` + this process).

    The difference between two snapshots tells how much CPU other work took while we measured.
    """
    tick = os.sysconf("SC_CLK_TCK")
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    jiffies = [int(x) for x in fields]
    idle = jiffies[3] + (jiffies[4] if len(jiffies) > 4 else 0)  # idle + iowait
    busy = (sum(jiffies[:8]) - idle) / tick  # guest time is already inside user
    ours = sum(os.times()[:4])
    for pid, rest in session_stats(sid).items():
        if pid != os.getpid():
            ours += sum(int(x) for x in rest[11:15]) / tick  # utime stime cutime cstime
    return busy, ours


def foreign_cpu_share(
    before: tuple[float, float], after: tuple[float, float], wall_s: float
) -> float:
    """Share of the machine's CPU (0..1) used by anything but the measured group and us."""
    cores = os.cpu_count() or 1
    foreign = (after[0] - before[0]) - (after[1] - before[1])
    return max(foreign, 0.0) / (wall_s * cores) if wall_s > 0 else 0.0


def sh(cmd: list[str]) -> str:
    """Run a command in the repository; its stdout (raises on a non-zero exit)."""
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout


def cmdline(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def md_row(cells: Sequence[object], width: int = 0) -> str:
    """One markdown table line; a row of fewer than `width` cells ends in empty ones."""
    return "| " + " | ".join(str(c) for c in cells) + " |" + " |" * (width - len(cells))


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the header, its rule, then one line per row of cells."""
    width = len(header)
    return [md_row(header), "|" + "---|" * width, *(md_row(r, width) for r in rows)]
