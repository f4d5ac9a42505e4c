"""The newer families as the engine reads them (runtime/models/config.py): Qwen3, Phi-3,
Gemma 3, Mixtral and Qwen3-MoE configs in both transformers spellings, the options refused by
name, Phi-3's fused tensors cut for TP exactly as the Llama-named tensors they hold, and
Mixtral's experts read and split as Qwen3-MoE's."""

from __future__ import annotations

import pytest
import torch

from contract.errors import BuildError
from contract.quant import Quantization, QuantSpec
from runtime.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from runtime.models.rope import inv_frequencies
from runtime.models.sharding import quant_spec_for, rules_for, shard_state_dict


def _hf(arch: str, **extra: object) -> dict:
    return {"architectures": [arch], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, **extra}


def test_the_new_families_are_supported() -> None:
    for arch in ("Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
                 "Qwen3MoeForCausalLM"):
        assert arch in SUPPORTED_ARCHITECTURES
    # Qwen2-MoE's shared expert (and its sigmoid gate) is not implemented.
    with pytest.raises(BuildError, match="unsupported architecture 'Qwen2MoeForCausalLM'"):
        ModelConfig.from_hf_config(_hf("Qwen2MoeForCausalLM"))


def test_gemma3_in_the_transformers_4_spelling() -> None:
    """rope_theta and rope_local_base_freq, every sixth layer global (sliding_window_pattern)."""
    cfg = ModelConfig.from_hf_config(_hf(
        "Gemma3ForCausalLM", head_dim=32, sliding_window=512, rope_theta=1e6,
        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh"))
    assert cfg.sliding_windows == (512,) * 5 + (0,)
    assert cfg.rope == RopeConfig(1e6, "linear", 8.0) and cfg.rope_local == RopeConfig(1e4)
    assert (cfg.norm_offset, cfg.sandwich_norms, cfg.qk_norm) == (1.0, True, True)
    assert cfg.embed_scale == 8.0 and cfg.attn_scale == 32**-0.5 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # the engine's config.json round trip
    inv = inv_frequencies(cfg.rope, 32)
    assert torch.allclose(inv * 8.0, inv_frequencies(RopeConfig(1e6), 32))


def test_qwen3_windows_only_when_switched_on() -> None:
    assert ModelConfig.from_hf_config(_hf("Qwen3ForCausalLM", sliding_window=4096)).sliding_windows == ()
    cfg = ModelConfig.from_hf_config(_hf("Qwen3ForCausalLM", sliding_window=64, use_sliding_window=True,
                                         max_window_layers=4))
    assert cfg.sliding_windows == (0,) * 4 + (64,) * 2 and cfg.qk_norm and cfg.attn_scale == 16**-0.5


def test_an_engine_config_written_before_the_families_reads_as_llama() -> None:
    d = ModelConfig.from_hf_config(_hf("LlamaForCausalLM")).to_dict()
    for k in ("hidden_act", "qk_norm", "norm_offset", "sandwich_norms", "embed_scale",
              "query_pre_attn_scalar", "sliding_windows", "rope_local"):
        del d[k]
    cfg = ModelConfig.from_dict(d)
    assert cfg.window(0) == 0 and not cfg.qk_norm and cfg.norm_offset == 0.0


@pytest.mark.parametrize(("extra", "match"), [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}, "partial_rotary"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "longrope"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_options_that_would_change_results_are_refused(extra: dict, match: str) -> None:
    with pytest.raises(BuildError, match=match):
        ModelConfig.from_hf_config(_hf("Phi3ForCausalLM", **extra))


@pytest.mark.parametrize("tp", [1, 2])
def test_phi3s_fused_tensors_shard_as_the_llama_tensors_they_hold(tp: int) -> None:
    """qkv_proj rows q | k | v and gate_up_proj rows gate | up: each rank's qkv holds its
    query heads and KV heads, its gate_up its rows of gate then of up (QKVParallelLinear,
    MergedColumnParallelLinear), whether cut from the fused or the separate tensors."""
    phi3 = ModelConfig.from_hf_config(_hf("Phi3ForCausalLM", num_hidden_layers=1))
    llama = ModelConfig.from_hf_config(_hf("LlamaForCausalLM", num_hidden_layers=1))
    g = torch.Generator().manual_seed(0)
    sep = {f"model.layers.0.self_attn.{p}_proj.weight": torch.randn(n, 64, generator=g)
           for p, n in (("q", 64), ("k", 32), ("v", 32))}
    sep |= {f"model.layers.0.mlp.{p}_proj.weight": torch.randn(96, 64, generator=g) for p in ("gate", "up")}
    rest = {n: torch.randn(*s, generator=g) for n, s in (
        ("model.layers.0.self_attn.o_proj.weight", (64, 64)), ("model.layers.0.mlp.down_proj.weight", (64, 96)),
        ("model.layers.0.input_layernorm.weight", (64,)), ("model.layers.0.post_attention_layernorm.weight", (64,)),
        ("model.embed_tokens.weight", (64, 64)), ("model.norm.weight", (64,)), ("lm_head.weight", (64, 64)))}
    fused = rest | {
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat([sep[f"model.layers.0.self_attn.{p}_proj.weight"]
                                                               for p in "qkv"]),
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat([sep[f"model.layers.0.mlp.{p}_proj.weight"]
                                                             for p in ("gate", "up")])}
    for rank in range(tp):
        a = shard_state_dict(fused.__getitem__, phi3, tp, rank, torch.float32)
        b = shard_state_dict((rest | sep).__getitem__, llama, tp, rank, torch.float32)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), rank


def test_mistral_windows_every_layer_unless_no_position_reaches_past_it() -> None:
    cfg = ModelConfig.from_hf_config(_hf("MistralForCausalLM", sliding_window=8,
                                         max_position_embeddings=64))
    assert cfg.sliding_windows == (8,) * 6
    assert ModelConfig.from_hf_config(_hf("MistralForCausalLM", sliding_window=64,
                                          max_position_embeddings=64)).sliding_windows == ()


_MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2}
# Qwen3-30B-A3B's spelling (num_experts; transformers 5 writes num_local_experts).
_QWEN3_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def test_mixtral_and_qwen3_moe_configs() -> None:
    mixtral = ModelConfig.from_hf_config(_hf("MixtralForCausalLM", **_MIXTRAL, sliding_window=8,
                                             max_position_embeddings=64))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 96)
    assert mixtral.moe and not mixtral.dense_mlp and mixtral.norm_topk_prob
    assert mixtral.sliding_windows == (8,) * 6 and not mixtral.qk_norm
    qwen = ModelConfig.from_hf_config(_hf("Qwen3MoeForCausalLM", **_QWEN3_MOE, sliding_window=8))
    assert (qwen.num_experts, qwen.moe_intermediate_size, qwen.norm_topk_prob) == (4, 32, True)
    assert qwen.qk_norm and qwen.sliding_windows == ()  # the window only with use_sliding_window
    written = {**_QWEN3_MOE, "num_local_experts": 4, "norm_topk_prob": False}
    del written["num_experts"]
    assert not ModelConfig.from_hf_config(_hf("Qwen3MoeForCausalLM", **written)).norm_topk_prob
    for cfg in (mixtral, qwen):
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert not ModelConfig.from_hf_config(_hf("Qwen3ForCausalLM")).moe


@pytest.mark.parametrize(("extra", "match"), [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
])
def test_qwen3_moe_layers_that_stay_dense_are_refused(extra: dict, match: str) -> None:
    with pytest.raises(BuildError, match=match):
        ModelConfig.from_hf_config(_hf("Qwen3MoeForCausalLM", **{**_QWEN3_MOE, **extra}))


def test_moe_tp_splits_the_experts_intermediate_size() -> None:
    cfg = ModelConfig.from_hf_config(_hf("Qwen3MoeForCausalLM", **{**_QWEN3_MOE, "moe_intermediate_size": 34}))
    cfg.check_tp(2)  # 34 / 2; the dense intermediate_size (96) is not run
    with pytest.raises(BuildError, match="expert intermediate size"):
        cfg.check_tp(4)


@pytest.mark.parametrize("tp", [1, 2])
def test_mixtrals_experts_shard_as_qwen3_moes(tp: int) -> None:
    """block_sparse_moe.gate and experts.{e}.w1 / w3 / w2 are Qwen3-MoE's mlp.gate and
    experts.{e}.gate_proj / up_proj / down_proj: each rank holds the whole router and, per
    expert, its rows of gate then up and its columns of down, as the dense MLP."""
    hf = {"num_hidden_layers": 1, "num_key_value_heads": 4}
    mixtral = ModelConfig.from_hf_config(_hf("MixtralForCausalLM", **hf, **_MIXTRAL))
    qwen = ModelConfig.from_hf_config(_hf("Qwen3MoeForCausalLM", **hf, **{**_QWEN3_MOE, "moe_intermediate_size": 96}))
    g = torch.Generator().manual_seed(0)
    rest = {n: torch.randn(*s, generator=g) for n, s in (
        *((f"model.layers.0.self_attn.{p}_proj.weight", (64, 64)) for p in "qkvo"),
        ("model.layers.0.input_layernorm.weight", (64,)), ("model.layers.0.post_attention_layernorm.weight", (64,)),
        *((f"model.layers.0.self_attn.{n}_norm.weight", (16,)) for n in "qk"),  # Qwen3-MoE's
        ("model.embed_tokens.weight", (64, 64)), ("model.norm.weight", (64,)), ("lm_head.weight", (64, 64)))}
    router = torch.randn(4, 64, generator=g)
    experts = {(e, p): torch.randn(*((64, 96) if p == "down" else (96, 64)), generator=g)
               for e in range(4) for p in ("gate", "up", "down")}
    ours = rest | {"model.layers.0.mlp.gate.weight": router} | {
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": t for (e, p), t in experts.items()}
    w = {"gate": "w1", "up": "w3", "down": "w2"}
    theirs = rest | {"model.layers.0.block_sparse_moe.gate.weight": router} | {
        f"model.layers.0.block_sparse_moe.experts.{e}.{w[p]}.weight": t for (e, p), t in experts.items()}
    for rank in range(tp):
        a = shard_state_dict(theirs.__getitem__, mixtral, tp, rank, torch.float32)
        b = shard_state_dict(ours.__getitem__, qwen, tp, rank, torch.float32)
        moe = {k for k in b if ".mlp." in k}
        assert moe == {"layers.0.mlp.gate.weight"} | {
            f"layers.0.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_up_proj", "down_proj")}
        assert all(torch.equal(a[k], b[k]) for k in moe), rank
        assert torch.equal(a["layers.0.mlp.gate.weight"], router)
        up = b["layers.0.mlp.experts.2.gate_up_proj.weight"]
        assert torch.equal(up, torch.cat([t.chunk(tp)[rank] for t in (experts[2, "gate"], experts[2, "up"])]))
        assert torch.equal(b["layers.0.mlp.experts.2.down_proj.weight"], experts[2, "down"].chunk(tp, 1)[rank])


def test_the_router_stays_float_when_the_experts_are_quantized() -> None:
    cfg = ModelConfig.from_hf_config(_hf("MixtralForCausalLM", **_MIXTRAL, num_hidden_layers=1))
    quant = Quantization("int8_wo", QuantSpec("int8", 0))
    specs = {r.name: quant_spec_for(r, cfg, quant) for r in rules_for(cfg)}
    assert specs["layers.0.mlp.gate.weight"] is None
    assert all(specs[f"layers.0.mlp.experts.{e}.{p}.weight"] == quant.linear
               for e in range(4) for p in ("gate_up_proj", "down_proj"))
