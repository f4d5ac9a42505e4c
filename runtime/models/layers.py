"""Tensor-parallel layers (Megatron/vLLM names) and the small dense pieces.

Each layer declares only its *local* shapes; how a full checkpoint tensor is cut into a
rank's piece is data in `runtime.models.sharding`, shared by the converter and tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from contract.layout import PANEL_COLUMNS
from contract.quant import QuantSpec
from runtime.models.panels import pairs_fit, qpanels_fit
from runtime.models.parallel import TPContext
from runtime.quant import dequantize_packed


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _Weight(nn.Module):
    """A linear layer's [out, in] weight: a plain `weight`, or quantized (`qweight`,
    `scales` and, with a zero point, `mins`; contract/quant.py) when `quant` is given."""

    def _init_weight(self, out: int, inp: int, dtype: torch.dtype, quant: QuantSpec | None,
                     panels: str = "") -> None:
        self.quant = quant
        # `panels`: how the build stored the weight (runtime/models/panels.py): "" row-major,
        # "panels16" (a float weight in K-major panels of 16 columns), "pairs16" (a float
        # weight in pair panels where its shape fits them: panels.pairs_fit). A quantized
        # weight given either is in pair panels where its shape fits (panels.qpanels_fit).
        self.panels = panels == "panels16" and quant is None
        self.pairs = panels == "pairs16" and quant is None and pairs_fit(out, inp)
        self.qpanels = (panels != "" and quant is not None
                        and qpanels_fit(out, inp, quant.group_of(inp)))
        if quant is None:
            self.weight = _empty(out, inp, dtype=dtype)
            return
        int4 = quant.kind == "int4"
        self.qweight = _empty(out, inp // 2 if int4 else inp, dtype=torch.uint8 if int4 else torch.int8)
        self.scales = _empty(out, quant.groups(inp), dtype=torch.float16)
        self.mins = _empty(out, quant.groups(inp), dtype=torch.float16) if quant.zero_point else None
        self.group = quant.group_of(inp)

    def _linear(self, x: torch.Tensor, b: torch.Tensor | None, tp: TPContext,
                float_out: bool = False) -> torch.Tensor:
        if self.quant is None:
            return linear(x, self.weight, b, tp, self.panels, self.pairs, float_out)
        if self.qpanels:
            return torch.ops.aotllm.linear_qpanel(x, self.qweight, self.scales, self.mins, b,
                                                  self.group, float_out)
        return qlinear(x, self.qweight, self.scales, self.mins, b, self.group, tp, float_out)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tp: TPContext,
           panels: bool = False, pairs: bool = False, float_out: bool = False) -> torch.Tensor:
    """x W^T + b: our weight-streaming kernel for the few rows of a decode step when the
    engine has our kernels (it passes larger batches to at::linear itself), or our panel
    or pair-panel kernel when the build stored W so (only engines with our kernels do).
    `float_out`: the result in float32, summed in float32 and never rounded to x's dtype
    (the LM head's logits: a bf16 rounding ties tokens a bf16 step apart)."""
    if panels:
        return torch.ops.aotllm.linear_panel(x, w, b, float_out)
    if pairs:
        return torch.ops.aotllm.linear_pairs(x, w, b, float_out)
    if tp.use_kernels:
        return torch.ops.aotllm.linear(x, w, b, float_out)
    if float_out and x.dtype != torch.float32:  # the reference: bf16 values, float32 products
        return F.linear(x.float(), w.float(), None if b is None else b.float())
    return F.linear(x, w, b)


def qlinear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
            b: torch.Tensor | None, group: int, tp: TPContext,
            float_out: bool = False) -> torch.Tensor:
    """x W^T + b with W quantized: our kernels (runtime/kernels/quant_linear.cpp), or the
    reference the eager engines run: W dequantized in float32, cast to x's dtype, F.linear
    (`float_out`: as `linear`)."""
    if tp.use_kernels:
        if qweight.dtype == torch.int8:
            return torch.ops.aotllm.linear_int8(x, qweight, scales, b, group, float_out)
        return torch.ops.aotllm.linear_int4(x, qweight, scales, mins, b, group, float_out)
    w = dequantize_packed(qweight, scales, mins, group, x.dtype)
    return linear(x, w, b, tp, float_out=float_out)


class ReplicatedLinear(_Weight):
    """y = x W^T with the whole float W on every rank (an MoE router); no communication."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self._init_weight(out_features, in_features, dtype, None)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, None, self.tp)


class ColumnParallelLinear(_Weight):
    """y = x W^T with W's output rows split across ranks; no communication."""

    def __init__(self, in_features: int, out_local: int, bias: bool, tp: TPContext,
                 dtype: torch.dtype, quant: QuantSpec | None = None, panels: str = "") -> None:
        super().__init__()
        self._init_weight(out_local, in_features, dtype, quant, panels)
        self.bias = _empty(out_local, dtype=dtype) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias, self.tp)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its heads' rows [q | k | v]."""

    def __init__(
        self, hidden: int, head_dim: int, q_heads_local: int, kv_heads_local: int, bias: bool,
        tp: TPContext, dtype: torch.dtype, quant: QuantSpec | None = None, panels: str = "",
    ) -> None:
        super().__init__(hidden, (q_heads_local + 2 * kv_heads_local) * head_dim, bias, tp, dtype,
                         quant, panels)
        self.q_size = q_heads_local * head_dim
        self.kv_size = kv_heads_local * head_dim

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate and up projections fused: each rank holds [gate_shard | up_shard]."""


class RowParallelLinear(_Weight):
    """y = all_reduce(x_shard W_shard^T): W's input columns split across ranks.
    `reduce_results` False: the rank's partial sum, for a caller that adds several of them
    before one all-reduce (an MoE layer's experts)."""

    def __init__(self, in_local: int, out_features: int, tp: TPContext, dtype: torch.dtype,
                 quant: QuantSpec | None = None, panels: str = "",
                 reduce_results: bool = True) -> None:
        super().__init__()
        self._init_weight(out_features, in_local, dtype, quant, panels)
        self.tp = tp
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, None, self.tp)
        return self.tp.all_reduce(y) if self.reduce_results else y


class VocabParallelEmbedding(_Weight):
    """Each rank holds a contiguous vocabulary slice; out-of-slice ids contribute zeros.
    Quantized only when it is tied to a quantized LM head (one tensor bound to both)."""

    def __init__(self, vocab_local: int, hidden: int, tp: TPContext, dtype: torch.dtype,
                 quant: QuantSpec | None = None, panels: str = "") -> None:
        super().__init__()
        self._init_weight(vocab_local, hidden, dtype, quant, panels)
        self.dtype = dtype
        self.tp = tp
        self.vocab_local = vocab_local
        # A parameter, not a Python int or a buffer (AOTInductor folds those into the
        # program): every rank's compiled program stays identical and the rank-specific
        # offset arrives with the rank's weights.
        self.vocab_start = nn.Parameter(torch.tensor(tp.rank * vocab_local), requires_grad=False)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.panels:  # the tied LM head's panels: row v is column v % 16 of panel v // 16
            w = self.weight.view(self.vocab_local // PANEL_COLUMNS, -1, PANEL_COLUMNS)
            return w[ids // PANEL_COLUMNS, :, ids % PANEL_COLUMNS]  # [T, hidden]
        if self.pairs:  # the tied LM head's pair panels: [panel, pair of k, column, k % 2]
            w = self.weight.view(self.vocab_local // PANEL_COLUMNS, -1, PANEL_COLUMNS, 2)
            return w[ids // PANEL_COLUMNS, :, ids % PANEL_COLUMNS].flatten(1)  # [T, hidden]
        if self.quant is None:
            return F.embedding(ids, self.weight)
        # Only the looked-up rows are dequantized (the reference's arithmetic, row by row).
        mins = None if self.mins is None else self.mins[ids]
        return dequantize_packed(self.qweight[ids], self.scales[ids], mins, self.group, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, hidden]
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_local)
        out = self._rows(local.clamp(0, self.vocab_local - 1))
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(_Weight):
    """Logits for the rank's vocabulary slice, gathered so every rank holds all of them."""

    def __init__(self, vocab_local: int, hidden: int, tp: TPContext, dtype: torch.dtype,
                 quant: QuantSpec | None = None, panels: str = "") -> None:
        super().__init__()
        self._init_weight(vocab_local, hidden, dtype, quant, panels)
        self.tp = tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h [L, hidden] -> [L, vocab] float32
        # float32 logits, gathered as float32 (TensorRT-LLM's default `logits_dtype`): in
        # bf16 SmolLM2's "The" and "L" tie on the demo question and the tie went to "L".
        return self.tp.all_gather_last_dim(self._linear(h, None, self.tp, float_out=True))


class RMSNorm(nn.Module):
    """`offset` 1.0: Gemma's norm, whose scale is (1 + w), applied in float32 before the cast
    back (transformers' Gemma3RMSNorm); 0.0: Llama's, w applied in the model dtype."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = _empty(hidden, dtype=dtype)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like transformers does, then scale in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation (transformers' gelu_pytorch_tanh; Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}
