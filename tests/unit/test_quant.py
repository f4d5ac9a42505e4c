"""Quantized weights: quantize/dequantize round trips and their error bounds, the packed
layout, GGUF blocks taken over bit for bit, the TP split that would cut a group refused
with its reason, and the manifest / engine id covering the scheme."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from contract.errors import BuildError
from contract.manifest import Manifest, Source, engine_id, engine_inputs
from contract.profile import BuildProfile
from contract.quant import NONE, Quantization, QuantSpec
from contract.target import Target
from pipeline.cli import main
from pipeline.gguf import gguf_quant_getter, gguf_quantization
from runtime.models.config import ModelConfig
from runtime.models.sharding import ShardRule, shard_qtensor
from runtime.quant import dequantize_packed, pack_int4, quantize, unpack_int4
from tests.conftest import make_tiny_checkpoint

SPECS = [QuantSpec("int8", 0), QuantSpec("int8", 32), QuantSpec("int4", 32), QuantSpec("int4", 64),
         QuantSpec("int4", 128), QuantSpec("int4", 32, zero_point=True)]


def _weight(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    w[3, 7] = 0.9  # an outlier: its group's scale must cover it
    w[5] = 0.0  # an all-zero row: scale 0, exactly zero back
    return w


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_round_trip_error_is_within_half_a_step(spec: QuantSpec) -> None:
    w = _weight()
    qt = quantize(w, spec)
    back = qt.dequantize()
    n, k = w.shape
    step = qt.scales.float().abs().repeat_interleave(qt.group, 1)[:, :k]
    err = (back - w).abs()
    # Round to nearest: half a step. Symmetric int4 may clip the group's extreme when that
    # lowers the group's squared error (its scale search maps it to +-t, t <= 9.5, while
    # the levels run from -8 to 7): at most 2.5 steps.
    bound = 0.5 if spec.kind == "int8" or spec.zero_point else 2.5
    assert (err <= bound * step + 1e-6).all()
    assert torch.equal(back[5], torch.zeros(k))
    # The stored tensors: packed layout, float16 scales, shapes from the contract.
    p = qt.packed()
    assert p["scales"].dtype == torch.float16 and p["scales"].shape == (n, spec.groups(k))
    assert p["qweight"].shape == (n, k // 2 if spec.kind == "int4" else k)
    assert ("mins" in p) == spec.zero_point
    assert torch.equal(dequantize_packed(p["qweight"], p["scales"], p.get("mins"), qt.group,
                                         torch.float32), back)


def test_int4_search_beats_llama_cpp_q4_0_and_int8_is_at_least_q8_0() -> None:
    w = _weight(64, 512, seed=1)
    q40 = torch.from_numpy(quants.dequantize(quants.quantize(w.numpy(), GGMLQuantizationType.Q4_0),
                                             GGMLQuantizationType.Q4_0))
    ours = quantize(w, QuantSpec("int4", 32)).dequantize()
    assert (ours - w).square().sum() < 0.95 * (q40 - w).square().sum()
    q80 = torch.from_numpy(quants.dequantize(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0),
                                             GGMLQuantizationType.Q8_0))
    # Q8_0 rounds with the float32 scale and then stores it as float16; we round with the
    # stored float16 scale, which can only lower the error.
    ours8 = quantize(w, QuantSpec("int8", 32)).dequantize()
    assert (ours8 - w).square().sum() <= (q80 - w).square().sum()
    assert (ours8 != q80).float().mean() < 0.01


def test_packed_int4_is_ggufs_block_layout() -> None:
    q = torch.randint(0, 16, (6, 96), dtype=torch.uint8)
    q[:, ::32] = 0  # level -8 in every block: Q4_0's scale is then exactly 1
    packed = pack_int4(q)
    assert torch.equal(unpack_int4(packed), q)
    # GGUF Q4_0 block: byte j = value j | value j + 16 << 4, per 32 values.
    block = quants.quantize((q.float() - 8).numpy(), GGMLQuantizationType.Q4_0).reshape(6, 3, 18)
    assert torch.equal(packed, torch.from_numpy(block[:, :, 2:].copy()).reshape(6, 48))


def test_ragged_last_group_round_trips() -> None:
    w = _weight(8, 576)  # 576 = 4 groups of 128 + one of 64
    qt = quantize(w, QuantSpec("int4", 128))
    assert qt.scales.shape == (8, 5)
    step = qt.scales.float().abs().repeat_interleave(128, 1)[:, :576]
    assert ((qt.dequantize() - w).abs() <= 2.5 * step + 1e-6).all()
    # The short last group's scale comes from its own 64 columns.
    peak = w[:, 512:].abs().amax(1)
    assert (qt.scales[:, 4].float().abs() <= peak / 7 + 1e-4).all()


# ---- GGUF blocks -------------------------------------------------------------------------

def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> None:
    w = GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        raw = quants.quantize(data, qtype) if qtype != GGMLQuantizationType.F32 else data
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _cfg(heads: int = 4, kv: int = 2, hidden: int = 64) -> ModelConfig:
    return ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": hidden,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv, "tie_word_embeddings": True})


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_are_taken_over_bit_for_bit(tmp_path: Path, qtype: str) -> None:
    t = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    hf = {n: rng.standard_normal(s).astype(np.float32) * 0.05 for n, s in {
        "q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (128, 64),
        "up": (128, 64), "down": (64, 128), "embd": (32, 64)}.items()}

    def permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"blk.0.attn_q.weight": permute(hf["q"], 4), "blk.0.attn_k.weight": permute(hf["k"], 2),
             "blk.0.attn_v.weight": hf["v"], "blk.0.attn_output.weight": hf["o"],
             "blk.0.ffn_gate.weight": hf["gate"], "blk.0.ffn_up.weight": hf["up"],
             "blk.0.ffn_down.weight": hf["down"]}
    tensors = {n: (w, t) for n, w in names.items()}
    tensors["token_embd.weight"] = (hf["embd"], GGMLQuantizationType.Q8_0)
    path = tmp_path / "m.gguf"
    _write_gguf(path, tensors)
    scheme = "int8_wo" if qtype == "Q8_0" else "int4_wo"
    quant = gguf_quantization(path, scheme, tied=True)
    assert quant.linear == QuantSpec("int8" if qtype == "Q8_0" else "int4", 32, qtype == "Q4_1")
    assert quant.lm_head == QuantSpec("int8", 32) and qtype in quant.source
    get = gguf_quant_getter(path, _cfg())
    hf_of = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
    for short, hf_name in hf_of.items():
        # llama.cpp's own dequantization of the blocks, with the rows put back in HF order.
        gguf_name = next(n for n in names if n.endswith({"q": "attn_q.weight", "k": "attn_k.weight",
                                                         "v": "attn_v.weight", "o": "attn_output.weight",
                                                         "gate": "ffn_gate.weight", "up": "ffn_up.weight",
                                                         "down": "ffn_down.weight"}[short]))
        want = quants.dequantize(quants.quantize(names[gguf_name], t), t)
        if short in "qk":
            heads = 4 if short == "q" else 2
            want = want.reshape(heads, want.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(want.shape)
        got = get(f"model.layers.0.{hf_name}.weight", quant.linear).dequantize()
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want))), short
    emb = get("model.embed_tokens.weight", quant.lm_head).dequantize()
    q8 = GGMLQuantizationType.Q8_0
    assert torch.equal(emb, torch.from_numpy(quants.dequantize(quants.quantize(hf["embd"], q8), q8)))
    with pytest.raises(BuildError, match="would quantize them again"):
        gguf_quantization(path, "int4_wo" if scheme == "int8_wo" else "int8_wo", tied=True)


def test_the_demos_q4_1_file_becomes_exactly_the_checkpoint_transformers_dequantizes() -> None:
    from demo.model import ensure_demo_gguf, ensure_demo_model
    from runtime.store.checkpoint import open_weights, read_model_config

    hf_dir, gguf = ensure_demo_model(), ensure_demo_gguf()
    cfg, _ = read_model_config(hf_dir)
    quant = gguf_quantization(gguf, "int4_wo", cfg.tie_word_embeddings)
    assert quant.linear == QuantSpec("int4", 32, zero_point=True)  # the demo file is Q4_1
    assert quant.lm_head == QuantSpec("int8", 32)  # its tied token_embd is Q8_0
    get, ref = gguf_quant_getter(gguf, cfg), open_weights(hf_dir)
    names = ["model.embed_tokens.weight"] + [
        f"model.layers.{i}.{p}.weight" for i in (0, 17, 29) for p in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    for name in names:
        spec = quant.lm_head if "embed" in name else quant.linear
        assert torch.equal(get(name, spec).dequantize(), ref(name).float()), name


# ---- tensor parallelism: groups follow their weights, never straddle ranks ---------------

def test_groups_split_with_their_columns_and_scales() -> None:
    cfg = _cfg()
    w = _weight(64, 128)
    rule = ShardRule("layers.0.mlp.down_proj.weight", ("d",), "row")
    for spec in (QuantSpec("int4", 32), QuantSpec("int8", 0), QuantSpec("int4", 64, True)):
        full = quantize(w, spec)
        pieces = [shard_qtensor(rule, [full], cfg, 2, r) for r in range(2)]
        assert torch.equal(torch.cat([p.dequantize() for p in pieces], dim=1), full.dequantize())
        assert all(p.group == (64 if spec.group_size == 0 else spec.group_size) for p in pieces)


def test_one_rank_keeps_a_short_last_group() -> None:
    """96 inputs in groups of 64 (64 + 32): nothing to straddle at TP=1; at TP=2 each rank's
    48 inputs would cut the first group, so that split is refused."""
    rule = ShardRule("layers.0.self_attn.o_proj.weight", ("o",), "row")
    full = quantize(_weight(16, 96), QuantSpec("int4", 64))
    one = shard_qtensor(rule, [full], _cfg(), 1, 0)
    assert one.scales.shape == (16, 2) and torch.equal(one.dequantize(), full.dequantize())
    with pytest.raises(BuildError, match="straddle"):
        shard_qtensor(rule, [full], _cfg(), 2, 0)


def test_a_split_that_would_cut_a_group_is_refused_with_the_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "tiny")  # o_proj: 64 inputs, 32 per rank at TP=2
    capsys.readouterr()
    argv = ["build", str(ckpt), "--tp", "2", "--backend", "eager", "--dtype", "float32",
            "--store", str(tmp_path / "engines"), "--quant", "int4_wo", "--quant-group-size", "64"]
    assert main(argv) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1  # one line: the cause and the remedy
    assert errors[0].startswith("error: layers.0.self_attn.o_proj.weight: its 64 inputs split 2 ways "
                          "give 32 per rank, which is not a multiple of the group size 64: a "
                          "group would straddle two ranks — choose --quant-group-size 32")
    assert not any((tmp_path / "engines").rglob("*.safetensors"))  # refused before any work
    # The same model at TP=1, or with groups of 32, builds.
    assert main([*argv[:3], "1", *argv[4:]]) == 0
    assert main([*argv[:-1], "32"]) == 0


def test_quant_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["build", str(tmp_path), "--tp", "1", "--backend", "eager"]
    assert main([*base, "--quant-group-size", "64"]) == 2
    assert "need --quant" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([*base, "--quant", "int4_wo", "--quant-group-size", "48"])
    assert e.value.code == 2 and "--quant-group-size" in capsys.readouterr().err
    assert main([*base, "--quant", "fp8"]) == 2
    assert "TensorRT-LLM" in capsys.readouterr().err


# ---- the manifest and the engine id ------------------------------------------------------

def _inputs(quant: Quantization) -> dict:
    return engine_inputs(source_digest="d" * 64, backend="aoti", target=Target("cpu", "x86_64", "amx"),
                         tp=1, dtype="bfloat16", profile=BuildProfile(), toolchain={}, quant=quant)


def test_the_engine_id_covers_the_scheme_and_unquantized_ids_are_unchanged() -> None:
    quants_ = [NONE, Quantization("int8_wo", QuantSpec("int8", 0)),
               Quantization("int8_wo", QuantSpec("int8", 32)),
               Quantization("int4_wo", QuantSpec("int4", 128)),
               Quantization("int4_wo", QuantSpec("int4", 64)),
               Quantization("int4_wo", QuantSpec("int4", 64), QuantSpec("int8", 0)),
               Quantization("int4_wo", QuantSpec("int4", 32, True), source="GGUF Q4_1")]
    ids = {engine_id(_inputs(q)) for q in quants_}
    assert len(ids) == len(quants_)
    assert "quant" not in _inputs(NONE)  # engines built before quantization keep their ids


def test_the_manifest_records_the_scheme() -> None:
    q = Quantization("int4_wo", QuantSpec("int4", 32, True), QuantSpec("int8", 32), "GGUF Q4_1")
    m = Manifest(engine_id="0" * 16, model_name="m", source=Source("u", None, "d" * 64),
                 backend="aoti", target=Target("cpu", "x86_64", "amx"), tp=1, dtype="bfloat16",
                 profile=BuildProfile(), toolchain={}, files=(), quant=q)
    d = json.loads(json.dumps(m.to_dict()))
    assert d["quant"]["linear"] == {"kind": "int4", "group_size": 32, "zero_point": True}
    assert Manifest.from_dict(d).quant == q
    plain = {k: v for k, v in d.items() if k != "quant"}
    assert Manifest.from_dict(plain).quant == NONE
    with pytest.raises(ValueError, match="layout 2 is not supported"):
        Manifest.from_dict({**d, "quant": {**d["quant"], "layout": 2}})
    assert "int4 group 32, zero point" in q.describe()
