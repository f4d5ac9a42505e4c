"""The sharding rule: how each of our parameters is cut from Hugging Face tensors.

This table is the single source of truth shared by the converter (build time) and the
tests. Names use `{i}` for the layer index.

kinds:
  replicate     the same full tensor on every rank
  column        split dim 0 (output rows) evenly
  row           split dim 1 (input columns) evenly
  vocab         split dim 0 by vocabulary slice (embedding, LM head)
  qkv           q rows by query head, k/v rows by KV head (replicated when KV heads < TP).
                When neither divides the other (ModelConfig.tp_heads), each rank takes its
                slots of runtime/models/kv_heads.py's plan: a head two ranks share is on
                both, or, where the plan cannot share, zero heads are appended
  o_proj        row, the input columns of each rank's slots likewise
  merged        gate and up each split dim 0, then concatenated

A mixture-of-experts layer (runtime/models/moe.py) replaces the MLP's rules: its router
`mlp.gate` is replicated (every rank routes every token, identically) and each expert
`{e}` is split as the dense MLP is: gate/up by rows, down by columns.

Sources are Llama's tensor names (the experts' Qwen3-MoE's); a family that stores them otherwise (Phi-3's fused
qkv_proj and gate_up_proj) is read through runtime/models/hf_names.py, which cuts its
tensors into these before the rule shards them. A rule `when` a config flag is set exists
for the families that have it (q/k bias, Qwen3's and Gemma's q/k norms, Gemma's norms
around the MLP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from contract.layout import PANEL_COLUMNS
from contract.quant import NONE, Quantization, QuantSpec
from runtime.models.config import ModelConfig
from runtime.models.hf_names import llama_names
from runtime.models.kv_heads import (
    group_width,
    kv_head_range,
    kv_head_rows,
    shared_slots,
    slot_heads,
    slot_qheads,
)
from runtime.models.rope import inv_frequencies
from runtime.quant import (
    QTensor,
    check_packable,
    q_cat_rows,
    q_pad_cols,
    q_pad_rows,
    q_rows,
    q_split_cols,
    quantize,
)


@dataclass(frozen=True, slots=True)
class ShardRule:
    name: str  # our parameter name
    sources: tuple[str, ...]  # Hugging Face tensor names
    kind: str
    when: str = ""  # present only when this ModelConfig flag is set (qkv_bias, qk_norm, ...)


LAYER_RULES: tuple[ShardRule, ...] = (
    ShardRule("layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "replicate"),
    ShardRule(
        "layers.{i}.self_attn.qkv_proj.weight",
        tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"),
        "qkv",
    ),
    ShardRule(
        "layers.{i}.self_attn.qkv_proj.bias",
        tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"),
        "qkv",
        when="qkv_bias",
    ),
    *(ShardRule(f"layers.{{i}}.self_attn.{n}.weight", (f"model.layers.{{i}}.self_attn.{n}.weight",),
                "replicate", when="qk_norm") for n in ("q_norm", "k_norm")),
    ShardRule("layers.{i}.self_attn.o_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",), "o_proj"),
    ShardRule(
        "layers.{i}.post_attention_layernorm.weight",
        ("model.layers.{i}.post_attention_layernorm.weight",),
        "replicate",
    ),
    ShardRule(
        "layers.{i}.mlp.gate_up_proj.weight",
        ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        "merged",
        when="dense_mlp",
    ),
    ShardRule("layers.{i}.mlp.down_proj.weight", ("model.layers.{i}.mlp.down_proj.weight",), "row",
              when="dense_mlp"),
    ShardRule("layers.{i}.mlp.gate.weight", ("model.layers.{i}.mlp.gate.weight",), "replicate",
              when="moe"),
    ShardRule(
        "layers.{i}.mlp.experts.{e}.gate_up_proj.weight",
        ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
        "merged",
        when="moe",
    ),
    ShardRule("layers.{i}.mlp.experts.{e}.down_proj.weight",
              ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), "row", when="moe"),
    *(ShardRule(f"layers.{{i}}.{n}.weight", (f"model.layers.{{i}}.{n}.weight",), "replicate",
                when="sandwich_norms")
      for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")),
)
GLOBAL_RULES: tuple[ShardRule, ...] = (
    ShardRule("embed_tokens.weight", ("model.embed_tokens.weight",), "vocab"),
    ShardRule("norm.weight", ("model.norm.weight",), "replicate"),
    ShardRule("lm_head.weight", ("lm_head.weight",), "vocab"),
)


def rules_for(cfg: ModelConfig) -> list[ShardRule]:
    """Every rule instantiated for this model's layers (and experts), in a fixed order."""
    rules: list[ShardRule] = []
    for i in range(cfg.num_hidden_layers):
        for r in LAYER_RULES:
            if r.when and not getattr(cfg, r.when):
                continue
            for e in range(cfg.num_experts) if "{e}" in r.name else (0,):
                rules.append(ShardRule(r.name.format(i=i, e=e),
                                       tuple(s.format(i=i, e=e) for s in r.sources), r.kind))
    for r in GLOBAL_RULES:
        # Tied: the head's shard is the embedding's shard (both split by vocabulary), so it
        # is stored once and bound to both names at load (see bind_tied).
        if r.name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        rules.append(r)
    return rules


def bind_tied(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full parameter set of a rank: the tied head shares the embedding's tensor(s)."""
    if cfg.tie_word_embeddings and not any(k.startswith("lm_head.") for k in weights):
        weights = {**weights, **{"lm_head." + k.split(".", 1)[1]: v for k, v in weights.items()
                                 if k.startswith("embed_tokens.") and k != "embed_tokens.vocab_start"}}
    return weights


_LINEAR_KINDS = ("qkv", "o_proj", "merged", "row", "column")


def quant_spec_for(rule: ShardRule, cfg: ModelConfig, quant: Quantization) -> QuantSpec | None:
    """The format a parameter is stored in: None for the model dtype."""
    if not quant.enabled or not rule.name.endswith(".weight"):
        return None
    if rule.name == "lm_head.weight" or (rule.name == "embed_tokens.weight" and cfg.tie_word_embeddings):
        return quant.lm_head
    if rule.name.startswith("layers.") and rule.kind in _LINEAR_KINDS:
        return quant.linear
    return None


def head_in_panels(cfg: ModelConfig, tp: int, quant: Quantization) -> bool:
    """With the "panels16" layout, the LM head (and the embedding, when tied to it: one
    tensor) is stored in panels too when it is a float tensor and a rank's vocabulary slice
    is whole panels, so that the embedding can gather its rows from them."""
    return quant.lm_head is None and (cfg.vocab_size // tp) % PANEL_COLUMNS == 0


def is_panel_weight(rule: ShardRule, cfg: ModelConfig, quant: Quantization, tp: int) -> bool:
    """A float weight the "panels16" layout stores in panels: the decoder layers' linears,
    and the LM head (see head_in_panels); an untied embedding stays row-major."""
    if rule.name == "lm_head.weight" or (rule.name == "embed_tokens.weight"
                                         and cfg.tie_word_embeddings):
        return head_in_panels(cfg, tp, quant)
    return (rule.name.startswith("layers.") and rule.name.endswith(".weight")
            and rule.kind in _LINEAR_KINDS and quant_spec_for(rule, cfg, quant) is None)


def is_qpanel_weight(rule: ShardRule, cfg: ModelConfig, quant: Quantization,
                     head: bool = False) -> bool:
    """A quantized linear of the decoder layers (and with `head`, the quantized LM head):
    the "panels16q" layouts store it in pair panels when a rank's piece fits them
    (runtime/models/panels.py qpanels_fit)."""
    if rule.name == "lm_head.weight":
        return head and quant.lm_head is not None
    return (rule.name.startswith("layers.") and rule.name.endswith(".weight")
            and rule.kind in _LINEAR_KINDS and quant_spec_for(rule, cfg, quant) is not None)


def _split(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank]


def _qrows(t: QTensor, tp: int, rank: int) -> QTensor:
    n = t.shape[0] // tp
    return q_rows(t, rank * n, (rank + 1) * n)


def shard_qtensor(
    rule: ShardRule, tensors: list[QTensor], cfg: ModelConfig, tp: int, rank: int
) -> QTensor:
    """shard_tensor for quantized weights: scales and mins follow their rows and groups."""
    what = rule.name
    if rule.kind == "replicate":
        out = tensors[0]
    elif rule.kind in ("column", "vocab"):
        out = _qrows(tensors[0], tp, rank)
    elif rule.kind == "row":
        out = q_split_cols(tensors[0], tp, rank, what)
    elif rule.kind == "merged":
        out = q_cat_rows([_qrows(t, tp, rank) for t in tensors])
    elif rule.kind in ("o_proj", "qkv") and (
            slots := shared_slots(cfg, tp, rank, tensors[0].spec)) is not None:
        if rule.kind == "o_proj":
            out = slot_qheads(tensors[0], slots, group_width(cfg), 1, what)
        else:
            q, k, v = tensors
            out = q_cat_rows([slot_qheads(q, slots, group_width(cfg), 0, what),
                              slot_qheads(k, slots, cfg.head_dim, 0, what),
                              slot_qheads(v, slots, cfg.head_dim, 0, what)])
    elif rule.kind == "o_proj":
        q_heads, _ = cfg.tp_heads(tp)
        out = q_split_cols(q_pad_cols(tensors[0], q_heads * cfg.head_dim, what), tp, rank, what)
    elif rule.kind == "qkv":
        d = cfg.head_dim
        q_heads, kv_heads = cfg.tp_heads(tp)
        q, k, v = tensors
        if kv_heads != cfg.num_key_value_heads:
            q, k, v = q_pad_rows(q, q_heads * d), q_pad_rows(k, kv_heads * d), q_pad_rows(v, kv_heads * d)
        q_local = q_heads // tp
        lo, hi = kv_head_range(cfg, tp, rank)
        out = q_cat_rows([q_rows(q, rank * q_local * d, (rank + 1) * q_local * d),
                          q_rows(k, lo * d, hi * d), q_rows(v, lo * d, hi * d)])
    else:
        raise ValueError(f"unknown shard kind {rule.kind!r}")
    check_packable(out, what)
    return out


def _pad_rows(t: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """Append zeros along `dim` up to `rows` (no copy when nothing is missing)."""
    missing = rows - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat((t, t.new_zeros(shape)), dim=dim)


def shard_tensor(
    rule: ShardRule, tensors: list[torch.Tensor], cfg: ModelConfig, tp: int, rank: int,
    linear: QuantSpec | None = None,
) -> torch.Tensor:
    """Cut rank `rank`'s piece of one parameter from its full source tensors (`linear`:
    the decoder linears' quantization, which the KV head plan depends on)."""
    if rule.kind == "replicate":
        return tensors[0]
    if rule.kind in ("column", "vocab"):
        return _split(tensors[0], 0, tp, rank)
    if rule.kind == "row":
        return _split(tensors[0], 1, tp, rank)
    if rule.kind == "merged":
        return torch.cat([_split(t, 0, tp, rank) for t in tensors], dim=0)
    slots = shared_slots(cfg, tp, rank, linear) if rule.kind in ("o_proj", "qkv") else None
    if slots is not None and rule.kind == "o_proj":
        return slot_heads(tensors[0], slots, group_width(cfg), 1)
    if slots is not None:
        q, k, v = tensors
        return torch.cat((slot_heads(q, slots, group_width(cfg), 0),
                          slot_heads(k, slots, cfg.head_dim, 0), slot_heads(v, slots, cfg.head_dim, 0)))
    if rule.kind == "o_proj":
        q_heads, _ = cfg.tp_heads(tp)
        return _split(_pad_rows(tensors[0], q_heads * cfg.head_dim, dim=1), 1, tp, rank)
    if rule.kind == "qkv":
        d = cfg.head_dim
        q_heads, kv_heads = cfg.tp_heads(tp)
        q, k, v = tensors
        if kv_heads != cfg.num_key_value_heads:
            q, k, v = _pad_rows(q, q_heads * d), _pad_rows(k, kv_heads * d), _pad_rows(v, kv_heads * d)
        q_local = q_heads // tp
        lo, hi = kv_head_range(cfg, tp, rank)
        return torch.cat(
            (q[rank * q_local * d : (rank + 1) * q_local * d], k[lo * d : hi * d], v[lo * d : hi * d]),
            dim=0,
        )
    raise ValueError(f"unknown shard kind {rule.kind!r}")


QuantGetter = Callable[[str, QuantSpec], QTensor]


def shard_state_dict(
    get: Callable[[str], torch.Tensor], cfg: ModelConfig, tp: int, rank: int, dtype: torch.dtype,
    quant: Quantization = NONE, get_quantized: QuantGetter | None = None,
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s complete state dict (weights and buffers) from a full-checkpoint getter.

    With `quant`, the weights it covers are quantized whole (or taken already quantized
    from `get_quantized`, a GGUF's blocks) and then cut: `X.weight` becomes `X.qweight`,
    `X.scales` (and `X.mins`) in the kernels' packed layout.
    """
    get = llama_names(cfg, get)
    get_q = get_quantized or (lambda name, spec: quantize(get(name), spec))
    out: dict[str, torch.Tensor] = {}
    for rule in rules_for(cfg):
        spec = quant_spec_for(rule, cfg, quant)
        if spec is not None:
            qt = shard_qtensor(rule, [get_q(s, spec) for s in rule.sources], cfg, tp, rank)
            base = rule.name.removesuffix(".weight")
            out.update({f"{base}.{k}": v for k, v in qt.packed().items()})
            continue
        piece = shard_tensor(rule, [get(s) for s in rule.sources], cfg, tp, rank, quant.linear)
        out[rule.name] = piece.to(dtype).contiguous()
    # Buffers travel with the weights so that one compiled program serves every rank.
    out["embed_tokens.vocab_start"] = torch.tensor(rank * (cfg.vocab_size // tp), dtype=torch.int64)
    out["kv_head_rows"] = kv_head_rows(cfg, tp, rank, quant.linear)
    out["inv_freq"] = inv_frequencies(cfg.rope, cfg.head_dim)
    if cfg.rope_local is not None:
        out["inv_freq_local"] = inv_frequencies(cfg.rope_local, cfg.head_dim)
    return out
