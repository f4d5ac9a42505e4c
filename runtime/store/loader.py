"""Load a rank's weight shard: storage -> host buffer -> device, hashed on the way in.

The file is read once, in large chunks, into one pre-allocated host buffer (pinned when
the target is a GPU, so the host-to-device copy is one DMA); a second thread hashes each
chunk as soon as it lands, so verification costs no second read. Tensors are zero-copy
views into the (device) buffer, located from the safetensors header.

From an object store (runtime/store/objstore.py) the shard is read the same way, as parallel
ranged GETs straight into the buffer (no temporary file); parts land out of order and the
hasher takes each as soon as every part before it is in.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import queue
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from runtime.env import THP, flag

if TYPE_CHECKING:
    from runtime.store.objstore import ObjectStore

_CHUNK = 16 << 20
# safetensors dtype names -> torch dtypes (what the engine shards and checkpoints use).
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(slots=True)
class LoadedShard:
    path: Path
    weights: dict[str, torch.Tensor]
    nbytes: int
    sha256: str
    read_s: float  # storage -> host (hashing overlapped)
    h2d_s: float = 0.0  # host -> device
    buffer: torch.Tensor | None = field(default=None, repr=False)  # keeps the views alive

    @property
    def read_gbps(self) -> float:
        return self.nbytes / self.read_s / 1e9 if self.read_s else 0.0


def _hash_worker(q: queue.SimpleQueue, h: hashlib._Hash) -> None:  # type: ignore[name-defined]
    while (chunk := q.get()) is not None:
        h.update(chunk)


_HUGE = 2 << 20  # a transparent huge page on x86-64


def host_buffer(size: int, pin: bool = False) -> torch.Tensor:
    """`size` bytes of host memory for a shard. Unpinned (the CPU engines compute on it),
    it is backed by transparent huge pages where the kernel allows them (madvise mode):
    decode reads every weight once a step, and with 4 KiB pages a 100 MB model is 25,000
    TLB entries, walked again every step (in a VM, two-level walks)."""
    if pin or size < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE") or not flag(THP):
        return torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    # private: shared anonymous memory is shmem, which THP leaves alone (shmem_enabled)
    mm = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # (the slack lets the tensor start on a 2 MiB boundary)
    mm.madvise(mmap.MADV_HUGEPAGE)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mm)) % _HUGE
    return torch.frombuffer(mm, dtype=torch.uint8, count=size, offset=start)


def read_file_hashed(path: Path, pin: bool = False) -> tuple[torch.Tensor, str, float]:
    """The whole file in one uint8 host tensor, its sha256, and the seconds it took."""
    size = path.stat().st_size
    buf = host_buffer(size, pin)
    view = memoryview(buf.numpy()).cast("B")
    h = hashlib.sha256()
    q: queue.SimpleQueue = queue.SimpleQueue()
    hasher = threading.Thread(target=_hash_worker, args=(q, h), daemon=True)
    t0 = time.perf_counter()
    hasher.start()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < size:
            n = f.readinto(view[pos : pos + _CHUNK])
            if not n:
                raise OSError(f"{path}: unexpected end of file at byte {pos} of {size}")
            q.put(view[pos : pos + n])
            pos += n
    q.put(None)
    hasher.join()
    return buf, h.hexdigest(), time.perf_counter() - t0


def read_object_hashed(store: ObjectStore, key: str, size: int, pin: bool = False
                       ) -> tuple[torch.Tensor, str, float]:
    """An object of `size` bytes in one uint8 host tensor, read as parallel ranged GETs,
    hashed in order while the parts arrive; its sha256 and the seconds it took."""
    from runtime.store.objstore import read_into_hashed

    buf = host_buffer(size, pin)
    digest, secs = read_into_hashed(store, key, memoryview(buf.numpy()).cast("B"))
    return buf, digest, secs


def _header(buf: torch.Tensor) -> tuple[int, dict]:
    """A safetensors byte buffer's data offset and header."""
    header_len = struct.unpack("<Q", bytes(buf[:8].cpu().numpy()))[0]
    return 8 + header_len, json.loads(bytes(buf[8 : 8 + header_len].cpu().numpy()))


def tensors_from_safetensors(buf: torch.Tensor, align: int = 1) -> dict[str, torch.Tensor]:
    """Zero-copy views of every tensor in a safetensors byte buffer (any device); a tensor
    whose address is not a multiple of its item size (or of `align`) is copied."""
    base, header = _header(buf)
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = ST_DTYPES[info["dtype"]]
        start, end = (base + o for o in info["data_offsets"])
        raw = buf[start:end]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if raw.data_ptr() % max(itemsize, align):
            raw = raw.clone()  # misaligned: one copy of this tensor
        out[name] = raw.view(dtype).view(info["shape"])
    return out


# AOTInductor's GPU kernels assume every constant (weight) starts on a 16-byte boundary
# (torch/_inductor/codegen/triton_utils.py: "all constants are assumed to be aligned"),
# and AOTInductor itself places them on 64 bytes; safetensors packs tensors back to back
# after a header padded to 8 bytes only, so a shard's views may start 8 bytes off.
DEVICE_ALIGN = 64


def _device_shift(buf: torch.Tensor) -> int:
    """Where in a DEVICE_ALIGN-aligned allocation the shard's bytes start so that most of
    its tensor bytes are aligned (the few others are copied by tensors_from_safetensors)."""
    base, header = _header(buf)
    weight: dict[int, int] = {}
    for name, info in header.items():
        if name != "__metadata__":
            a, b = info["data_offsets"]
            r = (base + a) % DEVICE_ALIGN
            weight[r] = weight.get(r, 0) + b - a
    return (-max(weight, key=weight.__getitem__)) % DEVICE_ALIGN if weight else 0


def load_shard(path: Path, device: str = "cpu", store: ObjectStore | None = None,
               key: str = "", size: int = 0) -> LoadedShard:
    """A shard from a file, or with `store` from the object `key` of `size` bytes."""
    pin = device.startswith("cuda")
    if store is None:
        buf, digest, read_s = read_file_hashed(path, pin=pin)
    else:
        buf, digest, read_s = read_object_hashed(store, key, size, pin=pin)
    h2d_s = 0.0
    align = 1
    if pin:
        shift, align = _device_shift(buf), 16
        t0 = time.perf_counter()
        dev = torch.empty(buf.numel() + shift, dtype=torch.uint8, device=device)
        dev[shift:].copy_(buf, non_blocking=True)
        torch.cuda.synchronize()
        h2d_s = time.perf_counter() - t0
        buf = dev[shift:]
    return LoadedShard(path, tensors_from_safetensors(buf, align), buf.numel(), digest, read_s,
                       h2d_s, buf)
