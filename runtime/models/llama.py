"""One decoder for every family we build (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3,
Mixtral, Qwen3-MoE) over a paged KV cache, tensor parallel. The families differ in data only
(ModelConfig): Qwen3's and Gemma's per-head q/k norms, Gemma's (1 + w) norms around
attention and MLP, GeGLU, scaled embeddings, query_pre_attn_scalar and sliding-window layers
with their own RoPE, Mixtral's and Qwen3-MoE's routed experts in place of the MLP
(runtime/models/moe.py); Phi-3's fused checkpoint tensors are split by the converter
(runtime/models/hf_names.py).

`forward` is the engine's step function: flat tensor arguments only, so `torch.export`
can trace it with dynamic token, batch and block dimensions, and the same code runs
eagerly. The KV cache is an argument that `forward` writes in place.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from contract.layout import (
    FLOAT_PAIR_LAYOUTS,
    FLOAT_PANEL_LAYOUTS,
    QHEAD_LAYOUTS,
    QPANEL_LAYOUTS,
    WEIGHT_LAYOUTS,
)
from contract.quant import NONE, Quantization
from runtime.models.attention import AttentionMetadata, paged_attention, write_kv
from runtime.models.config import ModelConfig
from runtime.models.kv_heads import padded
from runtime.models.layers import (
    GATED_ACTS,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from runtime.models.moe import SparseMoeBlock
from runtime.models.parallel import TPContext
from runtime.models.rope import apply_rope, inv_frequencies
from runtime.models.sharding import head_in_panels


def local_heads(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) held by one rank; KV heads replicate when fewer than ranks."""
    q, kv = cfg.tp_heads(tp)
    return q // tp, max(1, kv // tp)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 quant: Quantization = NONE, panels: str = "", window: int = 0) -> None:
        super().__init__()
        self.use_kernels = tp.use_kernels
        self.hq, self.hk = local_heads(cfg, tp.size)
        self.d = cfg.head_dim
        self.scale = cfg.attn_scale
        self.window = window
        if cfg.qk_norm:  # over each head's head_dim, before RoPE (Qwen3, Gemma 3)
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype, cfg.norm_offset)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.d, self.hq, self.hk, cfg.qkv_bias, tp, dtype, quant.linear, panels
        )
        self.o_proj = RowParallelLinear(self.hq * self.d, cfg.hidden_size, tp, dtype, quant.linear,
                                        panels)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        block_index: torch.Tensor, block_offset: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = q.view(t, self.hq, self.d), k.view(t, self.hk, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, positions, inv_freq)
        write_kv(k_cache, v_cache, k, v.view(t, self.hk, self.d), block_index, block_offset)
        return self.o_proj(paged_attention(q, k_cache, v_cache, positions, meta, self.scale,
                                           self.use_kernels, self.window))


class MLP(nn.Module):
    """The gated MLP; an MoE layer's experts are MLPs of `intermediate_size` whose partial
    sums it all-reduces once (`reduce_results` False)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 quant: Quantization = NONE, panels: str = "", intermediate_size: int = 0,
                 reduce_results: bool = True) -> None:
        super().__init__()
        inter_local = (intermediate_size or cfg.intermediate_size) // tp.size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, 2 * inter_local, False, tp,
                                                       dtype, quant.linear, panels)
        self.down_proj = RowParallelLinear(inter_local, cfg.hidden_size, tp, dtype, quant.linear,
                                           panels, reduce_results)
        self.act = GATED_ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Llama's pre-norm layer; with `sandwich_norms` Gemma's: post_attention_layernorm
    normalises the attention's output before the residual add, and the MLP sits between
    pre_feedforward_layernorm and post_feedforward_layernorm."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 quant: Quantization = NONE, panels: str = "", layer: int = 0) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, tp, dtype, quant, panels, cfg.window(layer))
        self.post_attention_layernorm = norm()
        self.mlp: nn.Module
        if cfg.moe:
            experts = [MLP(cfg, tp, dtype, quant, panels, cfg.moe_intermediate_size,
                           reduce_results=False) for _ in range(cfg.num_experts)]
            self.mlp = SparseMoeBlock(cfg, tp, dtype, experts)
        else:
            self.mlp = MLP(cfg, tp, dtype, quant, panels)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        # Gemma 3's sliding layers rotate with their own RoPE base (the model's inv_freq_local).
        self.local_rope = cfg.rope_local is not None and cfg.window(layer) > 0

    def forward(self, residual: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                block_index: torch.Tensor, block_offset: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(residual), positions, inv_freq, k_cache, v_cache,
                           meta, block_index, block_offset)
        if not self.sandwich:
            residual = residual + a
            return residual + self.mlp(self.post_attention_layernorm(residual))
        residual = residual + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(residual))
        return residual + self.post_feedforward_layernorm(m)


class LlamaForCausalLM(nn.Module):
    """`use_kernels`: attention calls our fused CPU kernels (aoti engines compiled for a
    CPU; the library must be loaded, runtime/kernels); else tensor operations only.
    `quant`: the linears (and the LM head, with a tied embedding) hold quantized weights.
    `weight_layout`: how the decoder layers' float linear weights are stored
    (contract/layout.py); "panels16" and the "panels16q" layouts need our kernels."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 use_kernels: bool = False, quant: Quantization = NONE,
                 weight_layout: str = "rows") -> None:
        super().__init__()
        self.cfg = cfg
        tp = dataclasses.replace(tp, use_kernels=use_kernels)
        if weight_layout not in WEIGHT_LAYOUTS or (weight_layout != "rows" and not use_kernels):
            raise ValueError(f"weight layout {weight_layout!r} needs our kernels and one of "
                             f"{', '.join(WEIGHT_LAYOUTS)}")
        panels = weight_layout in FLOAT_PANEL_LAYOUTS
        head_panels = panels and head_in_panels(cfg, tp.size, quant)
        # How the build stored each weight (layers._Weight): float linears in K-major panels
        # or in pair panels; quantized ones in pair panels with the QPANEL_LAYOUTS only
        # ("panels16" engines keep them row-major).
        float_fmt = ("pairs16" if weight_layout in FLOAT_PAIR_LAYOUTS
                     else "panels16" if panels else "")
        qpairs = "pairs16" if weight_layout in QPANEL_LAYOUTS else ""
        layer_fmt = float_fmt if quant.linear is None else qpairs
        vocab_local = cfg.vocab_size // tp.size
        embed_quant = quant.lm_head if cfg.tie_word_embeddings else None
        if quant.lm_head is not None:
            head_fmt = "pairs16" if weight_layout in QHEAD_LAYOUTS else ""
        else:
            head_fmt = "panels16" if head_panels else ("pairs16" if float_fmt == "pairs16" else "")
        # A tied embedding is the head's tensor (stored once, bound to both: sharding.bind_tied),
        # so it is read in the head's layout; a quantized one keeps rows of its own.
        embed_fmt = head_fmt if cfg.tie_word_embeddings and quant.lm_head is None else ""
        self.embed_tokens = VocabParallelEmbedding(vocab_local, cfg.hidden_size, tp, dtype,
                                                   embed_quant, embed_fmt)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, dtype, quant, layer_fmt, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        # A tied float head is the embedding's one tensor (sharding.bind_tied); a tied
        # quantized head in pair panels leaves the embedding a row-major copy of its own.
        # A quantized head in pair panels with the QHEAD_LAYOUTS (its rows at 16 rows a step
        # took a fifth of a Q4_0 engine's decode step); a float one as the float linears
        # ("panels16" where head_in_panels): head_fmt above.
        self.lm_head = ParallelLMHead(vocab_local, cfg.hidden_size, tp, dtype, quant.lm_head,
                                      head_fmt)
        self.register_buffer("inv_freq", inv_frequencies(cfg.rope, cfg.head_dim), persistent=True)
        if cfg.rope_local is not None:
            self.register_buffer("inv_freq_local", inv_frequencies(cfg.rope_local, cfg.head_dim),
                                 persistent=True)
        # Gemma: the embedding times sqrt(hidden), rounded to the model dtype as transformers
        # rounds it (a Python float: AOTInductor folds it into the program).
        self.embed_scale = (torch.tensor(cfg.embed_scale, dtype=dtype, device="cpu").item()
                            if cfg.embed_scale != 1.0 else None)
        # Which rows each of this rank's KV heads attends (runtime/models/kv_heads.py: a
        # head shared with another rank for some rows, a zero head for none): a parameter
        # bound with the rank's weights, as embed_tokens.vocab_start, so that one program
        # serves every rank. Only a padded layout has anything but every row.
        hk = local_heads(cfg, tp.size)[1]
        self.kv_head_rows = nn.Parameter(torch.tensor([[1, 0, 1]] * hk), requires_grad=False)
        self.padded_kv = padded(cfg, tp.size)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        slot_mapping: torch.Tensor,  # [T]
        out_index: torch.Tensor,  # [T]
        dec_q_index: torch.Tensor,  # [Bd]
        dec_block_tables: torch.Tensor,  # [Bd, Md]
        dec_ctx_lens: torch.Tensor,  # [Bd]
        pf_q_index: torch.Tensor,  # [Bp, Q]
        pf_block_tables: torch.Tensor,  # [Bp, Mp]
        logits_index: torch.Tensor,  # [L]
        k_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, Hk, D], written in place
        v_caches: list[torch.Tensor],  # per layer, likewise
    ) -> torch.Tensor:  # [L, vocab] float32
        meta = AttentionMetadata(
            slot_mapping, out_index, dec_q_index, dec_block_tables, dec_ctx_lens,
            pf_q_index, pf_block_tables, self.kv_head_rows if self.padded_kv else None,
        )
        block_size = k_caches[0].shape[1]
        block_index, block_offset = slot_mapping // block_size, slot_mapping % block_size
        residual = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        for i, layer in enumerate(self.layers):
            inv_freq = self.inv_freq_local if layer.local_rope else self.inv_freq
            residual = layer(residual, positions, inv_freq, k_caches[i], v_caches[i], meta,
                             block_index, block_offset)
        h = self.norm(residual[logits_index])  # [L, hidden]
        return self.lm_head(h)  # float32
