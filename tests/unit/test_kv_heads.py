"""The TP head plan (runtime/models/kv_heads.py): where the ranks cannot split the KV heads
evenly, a head that straddles two ranks is shared, each attending it for its share of the
rows, so every rank does the same attention work; the shards cut for it, float and
quantized, hold exactly the heads the plan says."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from contract.quant import QuantSpec
from runtime.models.config import ModelConfig
from runtime.models.kv_heads import (
    ZERO_SLOT,
    KVSlot,
    kv_head_rows,
    kv_plan,
    rows_from_live,
    shares_heads,
)
from runtime.models.sharding import ShardRule, shard_qtensor, shard_tensor
from runtime.quant import quantize


def _cfg(heads: int, kv: int, head_dim: int = 16) -> ModelConfig:
    return ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": heads * head_dim,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim})


def test_smollm2s_three_kv_heads_over_two_ranks_share_the_middle_one() -> None:
    plan = kv_plan(_cfg(9, 3, 64), 2)
    assert plan == [[KVSlot(0), KVSlot(1, 2, 0, 1)], [KVSlot(1, 2, 1, 2), KVSlot(2)]]
    assert kv_head_rows(_cfg(9, 3, 64), 2, 1).tolist() == [[2, 1, 2], [1, 0, 1]]


@pytest.mark.parametrize(("kv", "tp"), [(3, 2), (5, 2), (5, 4), (6, 4), (3, 4), (7, 4), (5, 8),
                                        (4, 2), (8, 4), (1, 2), (2, 4)])
def test_every_position_of_every_head_is_attended_by_exactly_one_rank(kv: int, tp: int) -> None:
    """For each head and each position residue, one rank attends it; where the plan shares heads,
    every rank's work is the same H / tp heads."""
    cfg = _cfg(kv * 2, kv)
    plan = kv_plan(cfg, tp)
    assert len({len(r) for r in plan}) == 1  # one program: every rank has the same slots
    if tp > kv and cfg.tp_heads(tp)[1] == kv:  # replicated heads: each rank attends its own fully
        assert all(len(r) == 1 and r[0].modulus == 1 for r in plan)
        return
    for head in range(kv):
        for residue in range(tp):
            owners = [r for r, slots in enumerate(plan) for s in slots
                      if s.head == head and s.lo <= residue % s.modulus < s.hi]
            assert len(owners) == 1, (head, residue, plan)
    work = [sum(Fraction(s.hi - s.lo, s.modulus) for s in slots if s.head is not None)
            for slots in plan]
    if shares_heads(cfg, tp):
        assert work == [Fraction(kv, tp)] * tp
    assert all(s == ZERO_SLOT for slots in plan for s in slots if s.head is None)


def test_a_plan_that_cannot_share_appends_zero_heads() -> None:
    """7 heads over 4 ranks: 1.75 a rank would touch 3 heads with 2 slots."""
    assert not shares_heads(_cfg(14, 7), 4)
    assert [[s.head for s in r] for r in kv_plan(_cfg(14, 7), 4)] == [[0, 1], [2, 3], [4, 5], [6, None]]


@pytest.mark.parametrize(("spec", "shared"), [(None, True), (QuantSpec("int8", 0), True),
                                              (QuantSpec("int4", 32), True),
                                              (QuantSpec("int4", 64), True),
                                              (QuantSpec("int4", 128), False)])
def test_a_grouped_o_proj_shares_heads_only_on_whole_groups(spec: QuantSpec | None,
                                                            shared: bool) -> None:
    """SmolLM2: a KV head's group is 3 query heads of 64, 192 o_proj inputs: groups of 128
    would be cut, so that build keeps zero heads."""
    assert shares_heads(_cfg(9, 3, 64), 2, spec) is shared


def test_stop_29_shards_live_count_reads_as_rows() -> None:
    assert rows_from_live(1, 2).tolist() == [[1, 0, 1], [1, 0, 0]]


def _qkv_o(cfg: ModelConfig) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    d, hq, hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qkv = [torch.randn(n * d, cfg.hidden_size, generator=g) for n in (hq, hk, hk)]
    return qkv, torch.randn(cfg.hidden_size, hq * d, generator=g)


def test_shards_hold_the_plans_heads() -> None:
    """Rank 1 of 3 KV heads over 2 ranks: q, k, v rows and o_proj columns of heads 1 and 2."""
    cfg = _cfg(6, 3)
    (q, k, v), o = _qkv_o(cfg)
    qkv_rule = ShardRule("layers.0.self_attn.qkv_proj.weight", ("q", "k", "v"), "qkv")
    o_rule = ShardRule("layers.0.self_attn.o_proj.weight", ("o",), "o_proj")
    got = shard_tensor(qkv_rule, [q, k, v], cfg, 2, 1)
    assert torch.equal(got, torch.cat((q[32:96], k[16:48], v[16:48])))
    assert torch.equal(shard_tensor(o_rule, [o], cfg, 2, 1), o[:, 32:96])
    assert torch.equal(shard_tensor(o_rule, [o], cfg, 2, 0), o[:, 0:64])


@pytest.mark.parametrize("spec", [QuantSpec("int8", 0), QuantSpec("int4", 32),
                                  QuantSpec("int4", 32, zero_point=True), QuantSpec("int4", 64)],
                         ids=lambda s: s.describe())
def test_quantized_shards_cut_the_same_heads_with_their_groups(spec: QuantSpec) -> None:
    """A quantized shard dequantizes to the float shard of the dequantized weights, zero
    heads included (head_dim 32, groups of 2 x 32 = 64 o_proj inputs a KV head)."""
    cfg = _cfg(6, 3, 32)
    assert shares_heads(cfg, 2, spec)
    (q, k, v), o = _qkv_o(cfg)
    fq = [quantize(t, spec) for t in (q, k, v)]
    fo = quantize(o, spec)
    qkv_rule = ShardRule("layers.0.self_attn.qkv_proj.weight", ("q", "k", "v"), "qkv")
    o_rule = ShardRule("layers.0.self_attn.o_proj.weight", ("o",), "o_proj")
    for rank in range(2):
        want = shard_tensor(qkv_rule, [t.dequantize() for t in fq], cfg, 2, rank, spec)
        assert torch.equal(shard_qtensor(qkv_rule, fq, cfg, 2, rank).dequantize(), want)
        want = shard_tensor(o_rule, [fo.dequantize()], cfg, 2, rank, spec)
        assert torch.equal(shard_qtensor(o_rule, [fo], cfg, 2, rank).dequantize(), want)
