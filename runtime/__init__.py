"""What runs an engine: models, kernels, scheduler, sampler, ranks, engine files.

The layer above contract/ (docs/design.md §6)."""

import os as _os

from runtime.env import CPU_ISA as _CPU_ISA
from runtime.host import isa_cap as _isa_cap
from runtime.host import isa_env as _isa_env

# AOTLLM_CPU_ISA holds ATen and oneDNN to the same level as our kernels: they read their
# variables at their first use, so setting them here (before any engine runs an op) is in
# time. Values a user set explicitly win.
if _CPU_ISA.raw():
    for _k, _v in _isa_env(_isa_cap() or "baseline").items():
        _os.environ.setdefault(_k, _v)
