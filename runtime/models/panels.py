"""Linear weights in panels of 16 output columns, K-major: the layout aoti engines store
for CPU targets without a native bf16 dot product (contract/layout.py `weight_layout_for`),
read by `aotllm::linear_panel` (runtime/kernels/panel_linear.cpp).

The packed tensor keeps the weight's shape [N, K], dtype and size: panel p (output columns
16p .. 16p + nr, nr = min(16, N - 16p)) is the block at 16p*K, element [k][j] at
16p*K + k*nr + j.
"""

from __future__ import annotations

import torch

from contract.layout import PANEL_COLUMNS
from contract.quant import QuantSpec


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """[N, K] row-major -> [N, K] in panels (a new contiguous tensor)."""
    n, k = w.shape
    full = n // PANEL_COLUMNS * PANEL_COLUMNS
    parts = [w[:full].reshape(n // PANEL_COLUMNS, PANEL_COLUMNS, k).transpose(1, 2).reshape(-1)]
    if full < n:  # a short last panel: [K][nr]
        parts.append(w[full:].t().reshape(-1))
    return torch.cat(parts).view(n, k)


def unpack_panels(p: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_panels: [N, K] in panels -> [N, K] row-major."""
    n, k = p.shape
    full = n // PANEL_COLUMNS * PANEL_COLUMNS
    flat = p.reshape(-1)
    rows = [flat[: full * k].view(n // PANEL_COLUMNS, k, PANEL_COLUMNS).transpose(1, 2).reshape(full, k)]
    if full < n:
        rows.append(flat[full * k:].view(k, n - full).t())
    return torch.cat(rows).contiguous()


# bf16 weights in pair panels (the "pairs16" layout of AMX targets): panel p, pair t = k // 2,
# column j at 16pK + 32t + 2j + k % 2, the order of the quantized ones' values below; each
# run of 32 k of a panel is one AMX B tile (runtime/kernels/pair_linear.cpp).


def pairs_fit(n: int, k: int) -> bool:
    """Whether a float [n, k] weight (a rank's piece) is stored in pair panels: whole panels
    and whole runs of 32 (an AMX tile's k)."""
    return n % PANEL_COLUMNS == 0 and k % 32 == 0


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """[N, K] row-major -> [N, K] in pair panels (a new contiguous tensor); pairs_fit(N, K)."""
    return _by_pairs(w).view(w.shape)


def unpack_pairs(p: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_pairs."""
    n, k = p.shape
    return p.view(n // PANEL_COLUMNS, k // 2, PANEL_COLUMNS, 2).permute(0, 2, 1, 3).reshape(n, k)


# Quantized weights (the "panels16q" layout): panels of 16 output columns whose int8 or
# int4 values are interleaved by pairs of k, what runtime/kernels/qpanel_linear.cpp reads:
# `vpmaddwd` multiplies a pair of a column's int8 weights by a broadcast pair of x's int16
# values, 8 columns a vector; two pairs of int4 values make a column's quad for `vpmaddubsw`
# or `vpdpbusd` against x's int8 values (qpanel_vnni.h). Shapes, dtypes and sizes stay those of the row-major tensors
# (contract/quant.py layout 1), only the order changes:
#   int8  q [N, K]: panel p, pair t = k // 2: 32 bytes at (16p * K / 2 + 16t) * 2, byte
#         2j + k % 2 holds column 16p + j.
#   int4  q [N, K / 2]: the same 32 values of a pair (value e = 2j + k % 2) in 16 bytes,
#         byte i = value i | value (i + 16) << 4.
#   scales, mins [N, groups] -> panel p, group g at (16p * groups + 16g), column j at + j.


def qpanels_fit(n: int, k: int, group: int) -> bool:
    """Whether a quantized [n, k] weight (a rank's piece) is stored in pair panels: whole
    panels, whole pairs of runs of 32, groups of whole runs."""
    return n % PANEL_COLUMNS == 0 and k % 32 == 0 and group % 32 == 0


def _int4_values(q: torch.Tensor, k: int) -> torch.Tensor:
    """Layout-1 int4 bytes [N, K / 2] -> values [N, K] (0..15): each run of 32 is 16 bytes,
    byte j = value j | value (j + 16) << 4."""
    b = q.view(q.shape[0], k // 32, 16)
    return torch.cat([b & 15, b >> 4], dim=2).reshape(q.shape[0], k)


def _int4_bytes(v: torch.Tensor) -> torch.Tensor:
    """Values [..., 32 * R] (0..15) -> bytes [..., 16 * R], byte i of each 32 = v_i | v_(i+16) << 4."""
    r = v.reshape(*v.shape[:-1], -1, 32)
    return (r[..., :16] | (r[..., 16:] << 4)).reshape(*v.shape[:-1], -1)


def _by_pairs(v: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/2, 16, 2] (panel, pair of k, column, k % 2), contiguous."""
    n, k = v.shape
    return v.reshape(n // PANEL_COLUMNS, PANEL_COLUMNS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def _group_panels(s: torch.Tensor) -> torch.Tensor:
    n, g = s.shape
    return s.reshape(n // PANEL_COLUMNS, PANEL_COLUMNS, g).transpose(1, 2).contiguous().view(n, g)


def _group_rows(s: torch.Tensor) -> torch.Tensor:
    n, g = s.shape
    return s.reshape(n // PANEL_COLUMNS, g, PANEL_COLUMNS).transpose(1, 2).contiguous().view(n, g)


def pack_qpanels(qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Layout-1 quantized tensors -> the same in pair panels (int4: qweight uint8)."""
    n = qweight.shape[0]
    if qweight.dtype == torch.int8:
        q = _by_pairs(qweight).view(qweight.shape)
    else:
        k = 2 * qweight.shape[1]
        q = _int4_bytes(_by_pairs(_int4_values(qweight, k)).reshape(n, k)).view(qweight.shape)
    return q, _group_panels(scales), None if mins is None else _group_panels(mins)


def unpack_qpanels(qweight: torch.Tensor, scales: torch.Tensor,
                   mins: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of pack_qpanels."""
    n = qweight.shape[0]
    if qweight.dtype == torch.int8:
        q = unpack_pairs(qweight).contiguous()
    else:
        k = 2 * qweight.shape[1]
        v = _int4_values(qweight, k).reshape(n // PANEL_COLUMNS, k // 2, PANEL_COLUMNS, 2)
        q = _int4_bytes(v.permute(0, 2, 1, 3).reshape(n, k)).contiguous()
    return q, _group_rows(scales), None if mins is None else _group_rows(mins)


def pack_qpanel_weight(shard: dict[str, torch.Tensor], name: str, spec: QuantSpec) -> None:
    """Put a rank shard's quantized weight `name` (`name.qweight`, `.scales`, `.mins`) in
    pair panels when its shape fits them (as the model's layers decide: qpanels_fit)."""
    q, s = shard[f"{name}.qweight"], shard[f"{name}.scales"]
    n, k = q.shape[0], q.shape[1] * (2 if spec.kind == "int4" else 1)
    if not qpanels_fit(n, k, spec.group_of(k)):
        return
    q, s, m = pack_qpanels(q, s, shard.get(f"{name}.mins"))
    shard[f"{name}.qweight"], shard[f"{name}.scales"] = q, s
    if m is not None:
        shard[f"{name}.mins"] = m
