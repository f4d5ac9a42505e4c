"""Tensor-parallel context and the explicit collectives used inside `forward`.

Collectives are torch functional collectives addressed by process-group *name*, so
`torch.export` traces them as `_c10d_functional` ops and AOTInductor compiles them into
the rank's package. The name baked in at build time is the default group's ("0"), which
is what `torch.distributed.init_process_group` gives the world group at serve time.

With `use_kernels` (aoti engines on CPU) they are our `aotllm::all_reduce/all_gather`
instead (runtime/kernels/shm_comm.cpp): shared memory between the ranks of one host, the
same functional collectives otherwise, chosen when the engine is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives  # registers the _c10d_functional ops

# The functional collective ops themselves, not funcol's Python wrappers: the wrappers ask
# whether a tracer is active, and the first such question imports torch._dynamo (6-7 s of
# a loaded host's start-up, in the first eager step). Traced by torch.export, these are the
# ops funcol emits anyway (the collective, then wait_tensor).
_C10D = torch.ops._c10d_functional

WORLD_GROUP_NAME = "0"


@dataclass(frozen=True, slots=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group_name: str = WORLD_GROUP_NAME
    use_kernels: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a TP group of size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.use_kernels:
            return torch.ops.aotllm.all_reduce(x, self.group_name, self.size)
        return _C10D.wait_tensor(_C10D.all_reduce(x, "sum", self.group_name))

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[n, d] on each rank -> [n, size * d], rank-major along the last dim."""
        if self.size == 1:
            return x
        if self.use_kernels:
            g = torch.ops.aotllm.all_gather(x, self.group_name, self.size)  # [size * n, d]
        else:
            g = _C10D.wait_tensor(
                _C10D.all_gather_into_tensor(x.contiguous(), self.size, self.group_name))
        n, d = x.shape
        return g.view(self.size, n, d).permute(1, 0, 2).reshape(n, self.size * d)
