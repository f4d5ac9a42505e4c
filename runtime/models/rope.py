"""Rotary position embedding (the rotate-half convention Hugging Face Llama uses)."""

from __future__ import annotations

import math

import torch

from runtime.models.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with llama3 or linear scaling when configured.

    Always on the host: models are built under `torch.device("meta")`, and meta tensors run
    torch's Python reference kernels, whose first use imports torch._refs and
    torch._decomp (seconds of a server's start-up, for a buffer the weights replace)."""
    arange = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    inv = 1.0 / (rope.theta ** (arange.float() / head_dim))
    if rope.rope_type == "linear":  # positions divided by the factor (Gemma 3's global layers)
        inv = inv / rope.factor
    if rope.rope_type == "llama3":
        # Same piecewise rule as transformers' _compute_llama3_parameters.
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D], positions [T] -> rotated q, k (same shapes and dtype)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, D]
    cos, sin = emb.cos(), emb.sin()

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

    return rot(q), rot(k)
