"""One rank of the shared-memory collectives test (spawned by tests/runtime/test_kernels.py).

    python -m tests.runtime.shm_worker LIB NAME RANK SIZE MODE OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from runtime import kernels


def main() -> None:
    lib, name, rank, size, mode, out = sys.argv[1:7]
    rank, size = int(rank), int(size)
    kernels.load(lib)
    torch.ops.aotllm.shm_init("g", name, rank, size, 1 << 16, rank == 0)
    if mode == "die" and rank == 1:
        time.sleep(0.5)
        raise SystemExit(0)  # gone without joining the collective
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.arange(1000, dtype=torch.float32) * (rank + 1) / 7).to(dtype)
        reduced = [torch.ops.aotllm.all_reduce(x, "g", size).float().tolist() for _ in range(5)]
        gathered = torch.ops.aotllm.all_gather(x.view(10, 100), "g", size).float().tolist()
        results[str(dtype)] = {"reduced": reduced, "gathered": gathered}
    t0 = time.perf_counter()
    row = torch.randn(1, 576).to(torch.bfloat16)
    for _ in range(2000):
        torch.ops.aotllm.all_reduce(row, "g", size)
    results["us_per_all_reduce"] = (time.perf_counter() - t0) / 2000 * 1e6
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
