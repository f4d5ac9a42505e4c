"""The shard loader: one read, hashed on the way in, zero-copy tensors equal safetensors'."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from runtime.loader import load_shard, tensors_from_safetensors
from serve.floors import host_copy_gbps, storage_read_gbps


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
    assert host_copy_gbps(8 << 20) > 0
