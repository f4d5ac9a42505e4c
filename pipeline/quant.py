"""`--quant`: the engine's quantization, decided and checked before any heavy work.

From a floating-point checkpoint the build quantizes (runtime/quant.py); from a GGUF whose
linears are Q8_0 / Q4_0 / Q4_1 it takes the blocks over unchanged (pipeline/gguf.py). A
split that would cut a quantization group between two ranks is refused here, with the
reason, by running the sharding rule on empty weights of the real shapes. The trtllm
backend maps the scheme onto TensorRT-LLM's own quantization (pipeline/compile/trtllm.py).
"""

from __future__ import annotations

import torch

from contract.errors import BuildError
from contract.quant import DEFAULT_INT4_GROUP_SIZE, NONE, Quantization, QuantSpec
from contract.target import Target
from pipeline.checkpoint import ResolvedSource
from pipeline.config import BuildConfig
from runtime.models.config import ModelConfig
from runtime.models.sharding import quant_spec_for, rules_for, shard_qtensor
from runtime.quant import QTensor

FP8_MIN_SM = 89  # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards


def _spec(scheme: str, group: int | None) -> QuantSpec:
    if scheme == "int8_wo":
        return QuantSpec("int8", group or 0)  # per output channel unless a group is given
    return QuantSpec("int4", group or DEFAULT_INT4_GROUP_SIZE)


def plan_quant(cfg: BuildConfig, src: ResolvedSource, model: ModelConfig, target: Target) -> Quantization:
    if cfg.backend == "trtllm":
        return _plan_trtllm(cfg, target)
    if cfg.quant == "fp8":
        raise BuildError("--quant fp8 runs on TensorRT-LLM's FP8 kernels only",
                         "use --backend trtllm on an sm_89 or newer GPU, or --quant int8_wo")
    if cfg.quant == "none":
        return NONE
    if src.kind == "gguf" and src.gguf_file is not None:
        from pipeline.gguf import gguf_quantization

        if cfg.quant_group_size is not None or cfg.quant_lm_head != "none":
            raise BuildError(
                "--quant-group-size and --quant-lm-head do not apply to a GGUF source: its "
                "blocks (groups of 32) are taken over as they are",
                "leave them out, or build from the floating-point checkpoint")
        quant = gguf_quantization(src.gguf_file, cfg.quant, model.tie_word_embeddings)
    else:
        head = None if cfg.quant_lm_head == "none" else _spec(cfg.quant_lm_head, cfg.quant_group_size)
        quant = Quantization(cfg.quant, _spec(cfg.quant, cfg.quant_group_size), head)
    check_layout(model, cfg.tp, quant)
    return quant


def _plan_trtllm(cfg: BuildConfig, target: Target) -> Quantization:
    if cfg.quant == "none":
        return NONE
    if cfg.quant_group_size is not None or cfg.quant_lm_head != "none":
        raise BuildError(
            "--quant-group-size and --quant-lm-head are not mapped onto TensorRT-LLM "
            "(its W8A16/W4A16 weight-only kernels are per channel)", "leave them out")
    if cfg.quant == "fp8":
        sm = int((target.sm or "sm_0").removeprefix("sm_"))
        if sm < FP8_MIN_SM:
            raise BuildError(f"--quant fp8 needs FP8 tensor cores (sm_89 or newer); the target is "
                             f"{target.sm}", "use --quant int8_wo or int4_wo on this GPU")
        return Quantization("fp8")
    return Quantization(cfg.quant, QuantSpec("int8" if cfg.quant == "int8_wo" else "int4", 0))


def check_layout(model: ModelConfig, tp: int, quant: Quantization) -> None:
    """Cut every quantized weight for every rank as the build will, on empty tensors of the
    real shapes: a group straddling two ranks (or an int4 row not in runs of 32) is refused
    now, with the reason, instead of after minutes of quantizing."""
    shapes = _hf_shapes(model)
    for rule in rules_for(model):
        spec = quant_spec_for(rule, model, quant)
        if spec is None:
            continue
        sources = [_empty(spec, *shapes[s]) for s in rule.sources]
        for rank in range(tp):
            shard_qtensor(rule, sources, model, tp, rank)


def _empty(spec: QuantSpec, n: int, k: int) -> QTensor:
    if spec.kind == "int4" and k % 32:
        raise BuildError(f"int4 weights need in_features divisible by 32; this model has {k}",
                         "use --quant int8_wo")
    g = spec.groups(k)
    mins = torch.empty(n, g, dtype=torch.float16) if spec.zero_point else None
    return QTensor(spec, torch.empty(n, k, dtype=torch.uint8), torch.empty(n, g, dtype=torch.float16),
                   mins, spec.group_of(k))


def _hf_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    h, d, i = m.hidden_size, m.head_dim, m.intermediate_size
    out = {"lm_head.weight": (m.vocab_size, h), "model.embed_tokens.weight": (m.vocab_size, h)}
    for layer in range(m.num_hidden_layers):
        p = f"model.layers.{layer}."
        out.update({
            p + "self_attn.q_proj.weight": (m.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (m.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (m.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, m.num_attention_heads * d),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
        for e in range(m.num_experts):  # MoE: Llama's MLP once per expert
            x, n = f"{p}mlp.experts.{e}.", m.moe_intermediate_size
            out.update({x + "gate_proj.weight": (n, h), x + "up_proj.weight": (n, h),
                        x + "down_proj.weight": (h, n)})
    return out
