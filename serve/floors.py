"""Physical floors measured at start-up, to put the load gate's numbers in context.

Each probe is short (tens of milliseconds) so that measuring does not slow the start.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import torch

_PROBE = 64 << 20


def storage_read_gbps(path: Path, nbytes: int = _PROBE) -> tuple[float, str]:
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


def host_copy_gbps(nbytes: int = _PROBE) -> float:
    """memcpy bandwidth into an already-faulted destination (the loader's best case)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    t0 = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - t0) / 1e9


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
