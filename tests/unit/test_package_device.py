"""Which device index a compiled package is loaded for: ranks name their GPU "cuda:N"."""

from __future__ import annotations

from runtime.executors.torch import device_index


def test_a_rank_s_gpu_index_reaches_the_package_loader() -> None:
    # before: `device == "cuda"` never held for "cuda:N", so a GPU package got -1 (the CPU's)
    assert [device_index(d) for d in ("cpu", "cuda", "cuda:0", "cuda:3")] == [-1, 0, 0, 3]
