"""The shard loader: one read, hashed on the way in, zero-copy tensors equal safetensors'."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from runtime.store.floors import files_read, host_copy_gbps, memory_read_gbps, storage_read_gbps
from runtime.store.loader import load_shard, tensors_from_safetensors


def test_load_shard_matches_safetensors_and_hashes_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(33, 7, dtype=torch.bfloat16),
        "b": torch.randn(5, dtype=torch.float32),
        "c": torch.tensor(12345, dtype=torch.int64),
        "d": torch.randn(3, 3, dtype=torch.float16),
    }
    path = tmp_path / "rank0.safetensors"
    save_file(tensors, str(path), metadata={"rank": "0"})
    shard = load_shard(path)
    assert shard.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert shard.nbytes == path.stat().st_size
    ref = load_file(str(path))
    assert set(shard.weights) == set(ref)
    for k, v in ref.items():
        assert shard.weights[k].dtype == v.dtype and torch.equal(shard.weights[k], v)


def test_views_share_the_one_buffer(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path))
    shard = load_shard(path)
    assert shard.buffer is not None
    assert shard.weights["w"].untyped_storage().data_ptr() == shard.buffer.untyped_storage().data_ptr()
    buf = shard.buffer.clone()
    assert torch.equal(tensors_from_safetensors(buf)["w"], torch.arange(64, dtype=torch.float32))


def test_floors_are_positive(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"\1" * (8 << 20))
    gbps, mode = storage_read_gbps(path)
    assert gbps > 0 and mode
    assert host_copy_gbps(8 << 20) > 0 and host_copy_gbps(8 << 20, repeats=2) > 0
    assert memory_read_gbps(8 << 20, repeats=2) > 0
    read = files_read([path, path])  # what bench/floors.py measures, larger
    assert read["bytes"] == 16 << 20 and read["gbs"] > 0


def _vma_of(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `addr`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= addr < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_a_cpu_shard_sits_on_huge_pages_where_the_kernel_allows(tmp_path: Path) -> None:
    """Decode reads every weight once a step: the shard's buffer starts on a 2 MiB boundary
    in a mapping marked for transparent huge pages, and the views outlive the shard."""
    path = tmp_path / "big.safetensors"
    w = torch.randn(1024, 1536)  # 6 MiB
    save_file({"w": w}, str(path))
    shard = load_shard(path)
    assert shard.buffer is not None and shard.buffer.data_ptr() % (2 << 20) == 0
    vma = _vma_of(shard.buffer.data_ptr())
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert vma.get("THPeligible") == "1", vma
    view = shard.weights["w"]
    del shard
    assert torch.equal(view, w)  # the mapping lives as long as a view of it
