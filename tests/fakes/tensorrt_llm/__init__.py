"""Contract fake of TensorRT-LLM 1.2.x, written from shared/reference/tensorrt-llm-1.2-api.md.

Importable as `tensorrt_llm` only inside tests (see tests/fakes/conftest_helper.py). It has
exactly the documented surface (tests/fakes/api_surface.py) and no GPU: engines are small
files and the "network" is a deterministic toy rule (tensorrt_llm/_fake/toy.py).

As the real package does, importing it imports `_utils`, whose import runs an MPI collective
over every rank of the job (see tensorrt_llm/_utils.py).
"""

from __future__ import annotations

import sys
from typing import Any

from . import _utils  # the import-time MPI collective, as the real package
from ._fake import env
from .builder import BuildConfig
from .mapping import Mapping

__all__ = ["BuildConfig", "Mapping"]

# The real _utils initialises MPI here even without a launcher (the process becomes an MPI
# singleton); the fake does not, but says which of the two this import would have been.
env.trace("import", argv=sys.argv, mpi="singleton" if _utils.mpi_comm() is None else "job")


def __getattr__(name: str) -> Any:
    # Read per access so a test can change FAKE_TRTLLM_VERSION without re-importing.
    if name == "__version__":
        return env.trtllm_version()
    raise AttributeError(f"module 'tensorrt_llm' has no attribute {name!r}")
