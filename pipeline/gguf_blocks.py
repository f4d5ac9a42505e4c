"""GGUF blocks -> float32, vectorized in torch: the legacy quants (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0), llama.cpp's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and the plain F32/F16/BF16.

Every type is bit-exact against ``gguf.quants.dequantize`` (tests/unit/test_gguf_blocks.py):
the same float32 products and sums in the same order, one whole tensor of blocks at a time
(a chunk of rows at a time for large ones), so a model with millions of blocks takes seconds,
not a Python loop per block. Layouts are ggml's (ggml-common.h); the comments give each
block's bytes in order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

QK_K = 256  # values in a K-quant super-block

# type name -> (values a block, bytes a block)
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}
_CHUNK_BLOCKS = 1 << 18  # blocks dequantized at once: bounds the temporaries (~0.5 GB for K)


def _f16(b: torch.Tensor) -> torch.Tensor:  # [n, 2] bytes -> [n, 1] float32
    return b.contiguous().view(torch.float16).to(torch.float32)


def _shift(x: torch.Tensor, shifts: list[int], dim: int) -> torch.Tensor:
    """x >> each shift, stacked as a new axis at ``dim`` (uint8 stays uint8)."""
    shape = [1] * (x.dim() + 1)
    shape[dim] = -1
    return x.unsqueeze(dim) >> torch.tensor(shifts, dtype=torch.uint8).view(shape)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [n, 16] -> [n, 32]: low nibbles, then high
    return torch.cat((qs & 15, qs >> 4), dim=1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:  # [n, 4] bytes (a little-endian u32) -> [n, 32]
    return (_shift(qh, list(range(8)), 2) & 1).reshape(qh.shape[0], 32)


def _q4_0(b):  # d:f16, qs[16]
    q = (_nibbles(b[:, 2:]).to(torch.int8) - 8).to(torch.float32)
    return _f16(b[:, :2]) * q


def _q4_1(b):  # d:f16, m:f16, qs[16]
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).to(torch.float32) + _f16(b[:, 2:4])


def _q5_0(b):  # d:f16, qh:u32, qs[16]
    q = _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q.to(torch.int8) - 16).to(torch.float32)


def _q5_1(b):  # d:f16, m:f16, qh:u32, qs[16]
    q = _nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.to(torch.float32) + _f16(b[:, 2:4])


def _q8_0(b):  # d:f16, qs:i8[32]
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _f16(b[:, :2])


def _q2_k(b):  # scales[16] (low 4 bits scale, high 4 min), qs[64], d:f16, dmin:f16
    n, sc = b.shape[0], b[:, :16]
    dl = (_f16(b[:, 80:82]) * (sc & 15).to(torch.float32)).view(n, 16, 1)
    ml = (_f16(b[:, 82:84]) * (sc >> 4).to(torch.float32)).view(n, 16, 1)
    q = (_shift(b[:, 16:80].reshape(n, 2, 32), [0, 2, 4, 6], 2) & 3).reshape(n, 16, 16)
    return (dl * q.to(torch.float32) - ml).reshape(n, QK_K)


def _q3_k(b):  # hmask[32], qs[64], scales[12] (16 x 6 bits), d:f16
    n = b.shape[0]
    lo = _shift(b[:, 96:104], [0, 4], 1).reshape(n, 16)
    hi = _shift(b[:, 104:108], [0, 2, 4, 6], 1).reshape(n, 16)
    sc = (((lo & 15) | ((hi & 3) << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (_f16(b[:, 108:110]) * sc).view(n, 16, 1)
    ql = _shift(b[:, 32:96].reshape(n, 2, 32), [0, 2, 4, 6], 2).reshape(n, 16, 16) & 3
    qh = (_shift(b[:, :32].reshape(n, 1, 32), list(range(8)), 2).reshape(n, 16, 16) & 1) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml get_scale_min_k4)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _q4_k(b):  # d:f16, dmin:f16, scales[12], qs[128]
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).view(n, 8, 1)
    q = (_shift(b[:, 16:].reshape(n, 4, 32), [0, 4], 2) & 15).reshape(n, 8, 32)
    return (d * q.to(torch.float32) - dm).reshape(n, QK_K)


def _q5_k(b):  # d:f16, dmin:f16, scales[12], qh[32], qs[128]
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).view(n, 8, 1)
    ql = (_shift(b[:, 48:].reshape(n, 4, 32), [0, 4], 2) & 15).reshape(n, 8, 32)
    qh = (_shift(b[:, 16:48].reshape(n, 1, 32), list(range(8)), 2) & 1).reshape(n, 8, 32)
    return (d * (ql | (qh << 4)).to(torch.float32) - dm).reshape(n, QK_K)


def _q6_k(b):  # ql[128] (low 4 bits), qh[64] (high 2 bits), scales:i8[16], d:f16
    n = b.shape[0]
    sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (_f16(b[:, 208:210]) * sc).view(n, 16, 1)
    ql = (_shift(b[:, :128].reshape(n, 2, 64), [0, 4], 2) & 15).reshape(n, 8, 32)
    qh = (_shift(b[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6], 2) & 3).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).to(torch.float32).reshape(n, 16, 16)
    return (d * q).reshape(n, QK_K)


_DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": lambda b: b.contiguous().view(torch.float32).clone(),
    "F16": lambda b: b.contiguous().view(torch.float16).to(torch.float32),
    "BF16": lambda b: b.contiguous().view(torch.bfloat16).to(torch.float32),
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def dequantize(data: np.ndarray, type_name: str) -> torch.Tensor:
    """A GGUF tensor's data (as ``GGUFReader`` gives it: rows of blocks) -> float32.

    The result has numpy's order of the dimensions, the last one the row, like
    ``gguf.quants.dequantize``; a new tensor.
    """
    if type_name not in _DEQUANT:
        raise NotImplementedError(f"GGUF type {type_name}")
    per_block, size = BLOCK_SIZES[type_name]
    raw = np.ascontiguousarray(data).view(np.uint8)
    lead, row_bytes = raw.shape[:-1], raw.shape[-1]
    if row_bytes % size:
        raise ValueError(f"a {type_name} row of {row_bytes} bytes is not whole blocks of {size}")
    with warnings.catch_warnings():  # a read-only memory map: only ever read here
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(raw.reshape(-1, size))
    fn = _DEQUANT[type_name]
    if blocks.shape[0] <= _CHUNK_BLOCKS:
        out = fn(blocks)
    else:
        out = torch.empty(blocks.shape[0], per_block, dtype=torch.float32)
        for i in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            out[i:i + _CHUNK_BLOCKS] = fn(blocks[i:i + _CHUNK_BLOCKS]).view(-1, per_block)
    return out.reshape(*lead, row_bytes // size * per_block)
