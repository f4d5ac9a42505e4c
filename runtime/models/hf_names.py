"""A family's checkpoint tensors under Llama's names, which the sharding rule reads.

Most families (Llama, Mistral, Qwen2, Qwen3, Gemma 3) name their tensors as Llama does;
the mixture-of-experts names are Qwen3-MoE's, Llama's MLP once per expert:

  mlp.gate.weight                          [E, hidden]: the router
  mlp.experts.{e}.{gate,up,down}_proj.weight

Mixtral stores the same tensors as block_sparse_moe.gate and block_sparse_moe.experts.{e}.w1
(gate), w3 (up) and w2 (down): renamed here (`checkpoint_name`), nothing cut.

Phi-3 stores two fused tensors per layer:

  self_attn.qkv_proj.weight  [(Hq + 2 Hk) D, hidden]: rows q | k | v
  mlp.gate_up_proj.weight    [2 I, hidden]: rows gate | up

which are cut here into q/k/v_proj and gate/up_proj, so that the rule then splits them for
TP as it splits Llama's: q by query head and k, v by KV head (QKVParallelLinear), gate and
up each by rows (MergedColumnParallelLinear). A fused tensor is read once for its pieces.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from runtime.models.config import ModelConfig

TensorGetter = Callable[[str], torch.Tensor]

_MIXTRAL = re.compile(r"(model\.layers\.\d+)\.mlp\.(gate|experts\.\d+\.(gate|up|down)_proj)\.weight")
_MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}
_FUSED = re.compile(r"(model\.layers\.\d+)\.(self_attn\.([qkv])_proj|mlp\.(gate|up)_proj)\.weight")


def checkpoint_name(cfg: ModelConfig, name: str) -> str:
    """The checkpoint's name for a tensor the rule names `name`, where it is a rename only
    (Mixtral's experts and router); `name` itself otherwise."""
    m = _MIXTRAL.fullmatch(name) if cfg.architecture == "MixtralForCausalLM" else None
    if m is None:
        return name
    layer, what, proj = m.groups()
    if proj is None:
        return f"{layer}.block_sparse_moe.gate.weight"
    expert = what.rsplit(".", 1)[0]  # experts.{e}
    return f"{layer}.block_sparse_moe.{expert}.{_MIXTRAL_EXPERT[proj]}.weight"


def llama_names(cfg: ModelConfig, get: TensorGetter) -> TensorGetter:
    """`get` as it answers for Llama's names (unchanged for the families that use them)."""
    if getattr(get, "llama_names", False):
        return get
    if cfg.architecture == "MixtralForCausalLM":
        def mixtral_get(name: str) -> torch.Tensor:
            return get(checkpoint_name(cfg, name))

        mixtral_get.llama_names = True  # type: ignore[attr-defined]
        return mixtral_get
    if cfg.architecture != "Phi3ForCausalLM":
        return get
    d, hq, hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qkv_rows = {"q": (0, hq * d), "k": (hq * d, hk * d), "v": ((hq + hk) * d, hk * d)}
    last: dict[str, torch.Tensor] = {}  # the fused tensor read last: its pieces come together

    def fused(name: str) -> torch.Tensor:
        if name not in last:
            last.clear()
            last[name] = get(name)
        return last[name]

    def phi3_get(name: str) -> torch.Tensor:
        m = _FUSED.fullmatch(name)
        if m is None:
            return get(name)
        layer, _, qkv, gate_up = m.groups()
        if qkv:
            start, n = qkv_rows[qkv]
            return fused(f"{layer}.self_attn.qkv_proj.weight").narrow(0, start, n)
        w = fused(f"{layer}.mlp.gate_up_proj.weight")
        i = cfg.intermediate_size
        return w.narrow(0, 0 if gate_up == "gate" else i, i)

    phi3_get.llama_names = True  # type: ignore[attr-defined]
    return phi3_get
