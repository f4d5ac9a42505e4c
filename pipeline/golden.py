"""The build's golden run: the freshly built engine runs the golden prompt on every rank
(under mpirun when TP > 1) and its tokens and top logits go into the manifest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from contract.profile import BuildProfile
from runtime.dist.comm import Comm
from runtime.dist.mpi import child_env, mpi_session, mpirun_argv
from runtime.executors.golden import run_local


def compute_golden(engine_dir: Path, backend: str, tp: int, dtype: str, profile: BuildProfile,
                   device: str = "cpu") -> dict[str, Any]:
    """Run the freshly built engine on every rank (under mpirun when tp > 1), on the
    target's device ("cpu" or "cuda")."""
    if tp == 1:
        record = run_local(engine_dir, backend, dtype, profile.tokens_per_block, Comm(),
                           profile.max_num_tokens, device, profile.max_batch_size)
        assert record is not None
        return record
    out = engine_dir / ".golden.json"
    cmd = [*mpirun_argv(tp), sys.executable, "-m", "runtime.executors.golden", str(engine_dir), backend,
           dtype, str(profile.tokens_per_block), str(out), str(profile.max_num_tokens), device,
           str(profile.max_batch_size)]
    with mpi_session(child_env()) as env:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the golden run under mpirun failed: {proc.stderr.strip()[-2000:]}")
    record = json.loads(out.read_text())
    out.unlink()
    return record
