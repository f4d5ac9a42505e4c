"""TensorRT-LLM's conversion and engine build, in a clean interpreter of its own.

    python -m pipeline.compile.trtllm_build REQUEST.json

Why a child: `import tensorrt_llm` initialises MPI (`tensorrt_llm/_utils.py` imports mpi4py and
splits COMM_WORLD at import), so a build process that imported it would be an MPI singleton
when it then starts `mpirun` for the golden run, and whether that works depends on the MPI
library. `pipeline build` itself never imports TensorRT-LLM (versions come from its
distribution metadata, runtime/executors/trtllm_setup.py); only this process does.

REQUEST.json: {"hf_dir", "engine_dir", "tp", "dtype", "profile", "quant"} (see
pipeline.compile.trtllm.convert_and_build). Everything TensorRT-LLM and TensorRT print (from
Python or C++) goes to stderr; stdout carries only this module's events, one JSON object a
line: {"advance": 1} per rank built, then {"stages": {...}} on success, or {"error", "remedy",
"exit_code"} on failure (exit code 1).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import IO, Any


def _events() -> IO[str]:
    """This module's event stream: the original stdout. fd 1 then points at stderr, so that
    nothing TensorRT-LLM prints (its C++ logger writes fd 1 directly) mixes with events."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def _emit(out: IO[str], event: dict[str, Any]) -> None:
    out.write(json.dumps(event) + "\n")
    out.flush()


def main(argv: list[str]) -> int:
    events = _events()
    try:
        from contract.errors import BuildError
        from contract.profile import BuildProfile
        from contract.quant import Quantization
        from pipeline.compile.trtllm import convert_and_build_here

        req = json.loads(Path(argv[0]).read_text())
        try:
            stages = convert_and_build_here(
                Path(req["hf_dir"]), Path(req["engine_dir"]), int(req["tp"]), req["dtype"],
                BuildProfile(**req["profile"]), Quantization.from_dict(req["quant"]),
                advance=lambda n: _emit(events, {"advance": n}),
            )
        except BuildError as e:
            _emit(events, {"error": e.cause, "remedy": e.remedy, "exit_code": e.exit_code})
            return 1
        _emit(events, {"stages": stages})
        return 0
    finally:
        events.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
