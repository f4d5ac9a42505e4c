"""Our GGUF block dequantizer (pipeline/gguf_blocks.py) against the gguf package's own,
bit for bit, on random blocks of every type: random bytes with finite float16 scales."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from pipeline import gguf_blocks
from pipeline.gguf_blocks import BLOCK_SIZES, dequantize

# Where each type keeps its float16 scales (d, dmin, m); every other byte is random.
F16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
          "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_rows(type_name: str, rows: int, blocks_a_row: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    _, size = BLOCK_SIZES[type_name]
    if type_name in ("F32", "F16", "BF16"):
        vals = rng.standard_normal(rows * blocks_a_row).astype(np.float32)
        if type_name == "F32":
            return vals.reshape(rows, blocks_a_row)
        if type_name == "F16":
            return vals.astype(np.float16).reshape(rows, blocks_a_row)
        bf = (vals.view(np.uint32) >> 16).astype(np.uint16)  # truncated: finite, any pattern
        return bf.view(np.uint8).reshape(rows, blocks_a_row * size)
    b = rng.integers(0, 256, size=(rows * blocks_a_row, size), dtype=np.uint8)
    for at in F16_AT[type_name]:
        # scales of either sign over a wide range, subnormals included
        scale = (rng.standard_normal(b.shape[0]) * 10.0 ** rng.integers(-7, 2, b.shape[0]))
        b[:, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, blocks_a_row * size)


def _same_bits(ours: np.ndarray, theirs: np.ndarray) -> bool:
    return ours.shape == theirs.shape and np.array_equal(
        ours.astype(np.float32).view(np.uint32), theirs.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("type_name", sorted(BLOCK_SIZES))
def test_bit_exact_against_gguf(type_name):
    data = random_rows(type_name, rows=24, blocks_a_row=3)
    ours = dequantize(data, type_name).numpy()
    theirs = quants.dequantize(data, GGMLQuantizationType[type_name])
    per_block = BLOCK_SIZES[type_name][0]
    assert ours.shape == (24, 3 * per_block)
    assert _same_bits(ours, theirs), f"{type_name}: {np.abs(ours - theirs).max()}"


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_chunked_equals_whole(type_name, monkeypatch):
    """A tensor larger than one chunk is dequantized chunk by chunk into the same bits."""
    data = random_rows(type_name, rows=10, blocks_a_row=2, seed=1)
    whole = dequantize(data, type_name)
    monkeypatch.setattr(gguf_blocks, "_CHUNK_BLOCKS", 3)
    chunked = dequantize(data, type_name)
    assert _same_bits(chunked.numpy(), whole.numpy())


def test_refusals():
    with pytest.raises(NotImplementedError, match="IQ2_XXS"):
        dequantize(np.zeros((1, 66), np.uint8), "IQ2_XXS")
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize(np.zeros((1, 145), np.uint8), "Q4_K")
