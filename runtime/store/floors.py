"""Physical floors: how fast this host reads storage and memory, and copies memory.

One module measures them for the server and the benches alike: the serve load gate puts its
numbers against short probes (tens of milliseconds, so that measuring does not slow the
start), bench/floors.py runs the same measurements larger and repeated.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from contract.refs import PROBE_BYTES, PROBE_KEY
from runtime.store.objstore import CONCURRENCY, PART_BYTES

if TYPE_CHECKING:
    from runtime.store.objstore import ObjectStore

_PROBE = 16 << 20  # enough for a stable figure; each probe costs start-up time
# The storage probe bypasses the page cache, so it waits for the disk itself: on a busy
# host 16 MiB took 1.1 s of the load gate (0.015 GB/s, bench/ready.py); 4 MiB bounds that.
_STORAGE_PROBE = 4 << 20


def storage_read_gbps(path: Path, nbytes: int = _STORAGE_PROBE) -> tuple[float, str]:
    """Sequential read of the first `nbytes` of `path`, bypassing the page cache when the
    filesystem allows O_DIRECT (then it neither benefits from nor warms the cache)."""
    size = min(nbytes, path.stat().st_size) // 4096 * 4096
    if size == 0:
        return 0.0, "file too small to measure"
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT requires
    mode = "O_DIRECT (page cache bypassed)"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd, mode = os.open(path, os.O_RDONLY), "buffered (may be served from page cache)"
    try:
        t0 = time.perf_counter()
        done = 0
        while done < size:
            n = os.readv(fd, [memoryview(buf)[done:]])
            if n <= 0:
                break
            done += n
        dt = time.perf_counter() - t0
    except OSError:
        os.close(fd)
        fd, mode = os.open(path, os.O_RDONLY), "buffered (may be served from page cache)"
        t0 = time.perf_counter()
        done = os.readv(fd, [buf])
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return done / dt / 1e9, mode


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed call (first touch of the
    pages, warm caches and thread pools)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def host_copy_gbps(nbytes: int = _PROBE, repeats: int = 1) -> float:
    """memcpy bandwidth (GB/s, bytes copied / time) into an already-faulted destination
    (the loader's best case): the best of `repeats` copies."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return nbytes / best_seconds(lambda: dst.copy_(src), repeats) / 1e9


def memory_read_gbps(nbytes: int = _PROBE, repeats: int = 1) -> float:
    """Memory read bandwidth (GB/s): the best of `repeats` full sums over nbytes of float32
    (torch, all its threads)."""
    t = torch.ones(nbytes // 4, dtype=torch.float32)  # [n]
    return nbytes / best_seconds(lambda: t.sum(), repeats) / 1e9


def drop_page_cache() -> bool:
    """Drop the page cache (needs root and a writable /proc/sys/vm); True when it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def files_read(files: Sequence[Path], chunk: int = 16 << 20) -> dict[str, Any]:
    """Read whole files front to back into one reused (pre-faulted) buffer, the page cache
    dropped first when allowed; GB/s and whether the read was cold."""
    cold = drop_page_cache()
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    t = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    seconds = time.perf_counter() - t
    return {
        "bytes": total,
        "seconds": seconds,
        "gbs": total / seconds / 1e9 if seconds > 0 else float("nan"),
        "page_cache": "dropped (cold)" if cold else "not dropped (warm: no permission)",
    }


def h2d_gbps(device: str, nbytes: int = _PROBE) -> float:
    """Pinned host -> device copy bandwidth."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - t0) / 1e9


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def store_read_gbps(store: ObjectStore, fallback_key: str, fallback_size: int,
                    nbytes: int = PROBE_BYTES) -> tuple[float, str]:
    """The object store's read floor: `nbytes` of its probe object (written by `pipeline
    push`; else of the shard itself) as the loader reads, parallel ranged GETs, but with
    nothing done to the bytes (no copy, no hash)."""
    size = store.head(PROBE_KEY)
    key = PROBE_KEY if size else fallback_key
    n = min(nbytes, size or fallback_size)
    if n == 0:
        return 0.0, "nothing to measure"
    secs = store.read_parts(key, n, lambda _offset, _data: None)
    return n / secs / 1e9, (f"{n >> 20} MiB of {store.url(key)}, {CONCURRENCY} ranged GETs "
                            f"of {PART_BYTES >> 20} MiB at a time")
