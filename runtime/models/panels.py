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
