"""RSS over many engine steps in one process: where a soak's memory growth comes from.

    python -m bench.rss_growth --engine DIR [--requests 1000] [--every 200] [--tracemalloc]

The engine's TP=1 runner under LLMEngine in this process (no HTTP, no MPI ranks): random
prompts of 1-40 tokens, 1-8 new tokens, greedy or sampled, 10 % cancelled, at most 8 in
flight. Every --every requests: VmRSS and the [heap] mapping's RSS, before and after
malloc_trim(0) (what glibc holds freed but unreturned), and with --tracemalloc the Python
allocations that grew most since the first report. Run it again under environment
variables to split the growth between its owners, e.g. ONEDNN_PRIMITIVE_CACHE_CAPACITY=0
(oneDNN's per-shape primitive cache) or MALLOC_MMAP_THRESHOLD_=65536 (large blocks mmapped,
so the heap cannot fragment). bench/results/latest/soak.md has a reading.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import time
import tracemalloc
from pathlib import Path

import torch

from contract.manifest import read_manifest
from runtime.core.scheduler import SchedulerConfig
from runtime.core.types import SamplingParams
from runtime.dist.comm import Comm
from runtime.executors.loop import LLMEngine
from runtime.executors.torch import runner_from_engine
from runtime.models.parallel import TPContext
from runtime.store.files import EngineFiles


def rss_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def heap_mib() -> int:
    """RSS of the brk heap (glibc's main arena)."""
    in_heap, kib = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:
            in_heap = fields[-1] == "[heap]"
        elif in_heap and fields[:1] == ["Rss:"]:
            kib += int(fields[1])
    return kib // 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rss_growth", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--every", type=int, default=200)
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    libc = ctypes.CDLL("libc.so.6")
    torch.set_num_threads(1)
    m = read_manifest(a.engine)
    if m.tp != 1:
        ap.error(f"{a.engine} is a TP={m.tp} engine; this runs one rank in one process: TP=1")
    p = m.profile
    blocks = 2048 // p.tokens_per_block + 1
    runner, _ = runner_from_engine(a.engine, m.backend, m.dtype, TPContext(0, 1), blocks,
                                   p.tokens_per_block, p.max_num_tokens,
                                   files=EngineFiles(a.engine, m))
    engine = LLMEngine(runner, SchedulerConfig(8, 256, p.tokens_per_block, blocks,
                                               min(512, p.max_seq_len), ()), Comm.from_mpi())
    rng = random.Random(a.seed)
    if a.tracemalloc:
        tracemalloc.start(10)
    first: tracemalloc.Snapshot | None = None
    t0, sent = time.time(), 0
    print(f"engine {a.engine} ({m.backend}, {m.dtype}); RSS {rss_mib()} MiB", flush=True)
    while sent < a.requests:
        while engine.num_unfinished() < 8 and sent < a.requests:
            prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(max_tokens=rng.randint(1, 8),
                                    temperature=rng.choice([0.0, 0.8]))
            engine.add_request(f"r{sent}", prompt, params, lambda ev: None)
            sent += 1
            if rng.random() < 0.1:
                engine.cancel(f"r{sent - 1}")
            if sent % a.every == 0:
                gc.collect()
                rss, heap = rss_mib(), heap_mib()
                libc.malloc_trim(0)
                print(f"requests {sent:6d}  {time.time() - t0:6.0f} s  RSS {rss} MiB, heap "
                      f"{heap} MiB; after malloc_trim RSS {rss_mib()} MiB, heap {heap_mib()} MiB",
                      flush=True)
                if a.tracemalloc:
                    snap = tracemalloc.take_snapshot()
                    if first is None:
                        first = snap
                    for stat in snap.compare_to(first, "lineno")[:6]:
                        print("   ", stat, flush=True)
        engine.step()
    while engine.step() is not None:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
