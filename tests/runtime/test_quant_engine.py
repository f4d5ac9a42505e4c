"""Quantized engines end to end: tiny int8_wo and int4_wo engines at TP=1 and TP=2, aoti and
eager, agree with each other, compute exactly what transformers computes on the dequantized
weights, stay within the quantization error of the float model, and carry a golden record
that their own warmup check passes and a corrupted shard fails.

aoti compiles are the slow part, so each compiled engine covers both kernels: int4 linears
(group 64: rows of 96 inputs end in a short group) with an int8 LM head at TP=1, int8 linears
with an int4 LM head at TP=2. The eager engines (the numerical reference) cover every scheme
and int4 group size (32, 64, 128) at TP=1. At TP=2 this model's 6 query heads are padded
to 8 (o_proj: 96 inputs to 128), which only groups of 32 fit (the refusal of the others is
tests/unit/test_quant.py's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from contract.layout import QHEAD_LAYOUTS, QPANEL_LAYOUTS, weight_layout_for
from contract.manifest import read_manifest
from contract.profile import BuildProfile
from contract.quant import Quantization
from pipeline.build import build_engine
from pipeline.config import BuildConfig
from runtime.executors.golden import check_golden, replay_golden, run_golden
from runtime.executors.runner import ModelRunner
from runtime.executors.torch import make_step_fn
from runtime.host import host_cpu_target
from runtime.models.config import ModelConfig
from runtime.models.parallel import TPContext
from runtime.models.sharding import rules_for
from runtime.quant import quantize
from runtime.store.loader import load_shard
from tests.conftest import run_mpirun
from tests.runtime.hf_reference import last_logits, rel_err
from tests.runtime.mpi_engine_worker import REFERENCE_TOKENS

PROFILE = BuildProfile(max_batch_size=4, max_num_tokens=32, max_seq_len=64, tokens_per_block=4)
# name -> (backend, tp, --quant, --quant-group-size, --quant-lm-head[, --dtype]); float32
# unless named: bf16 aoti engines on AVX2 and AVX512-BF16 hosts store their linears in pair
# panels ("panels16qh", "rowsqh": the quantized LM head too; runtime/kernels/qpanel_linear.cpp),
# float32 ones keep layout-1 rows.
ENGINES = {
    "eager-int8-tp1": ("eager", 1, "int8_wo", None, "none"),
    "eager-int8-tp2": ("eager", 2, "int8_wo", None, "none"),
    "eager-int4-tp1": ("eager", 1, "int4_wo", 32, "none"),
    "eager-int4-tp2": ("eager", 2, "int4_wo", 32, "none"),
    "eager-int4g64-tp1": ("eager", 1, "int4_wo", 64, "none"),
    "eager-int4g128-tp1": ("eager", 1, "int4_wo", 128, "none"),
    "eager-int4+8-tp1": ("eager", 1, "int4_wo", 64, "int8_wo"),
    "aoti-int4+8-tp1": ("aoti", 1, "int4_wo", 64, "int8_wo"),
    "eager-int8+4-tp2": ("eager", 2, "int8_wo", 32, "int4_wo"),
    "aoti-int8+4-tp2": ("aoti", 2, "int8_wo", 32, "int4_wo"),
    "eager-bf16-int4+8-tp1": ("eager", 1, "int4_wo", 32, "int8_wo", "bfloat16"),
    "aoti-bf16-int4+8-tp1": ("aoti", 1, "int4_wo", 32, "int8_wo", "bfloat16"),
    "eager-bf16-int8+8-tp2": ("eager", 2, "int8_wo", 32, "int8_wo", "bfloat16"),
    "aoti-bf16-int8+8-tp2": ("aoti", 2, "int8_wo", 32, "int8_wo", "bfloat16"),
}
# Logits of the float model vs the quantized one, relative to the largest logit, on this
# random tiny model (its logits are small and its weights have no outliers to spare): int8
# rounds each weight to 1/254 of its row's (group's) largest, int4 to 1/15 of its group's
# range; measured 0.9 % (int8), 11-18 % (int4 linears, groups 32-128), 8 % (int8 linears,
# int4 head): the coarsest format present sets the bound. It says "quantized, not garbage"; the
# exact check is the dequantized-weights reference above it.
QUANT_ERROR_BOUND = {"int8_wo": 0.03, "int4_wo": 0.25}


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama_kv3"]  # 3 KV heads: TP=2 appends a zero head (padded rows/cols)


@pytest.fixture(scope="module")
def engines(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    store = tmp_path_factory.mktemp("qengines")
    out = {}
    for name, (backend, tp, quant, group, head, *dtype) in ENGINES.items():
        cfg = BuildConfig(model=str(model), tp=tp, backend=backend,
                          dtype=dtype[0] if dtype else "float32", target="cpu",
                          profile=PROFILE, store=str(store), quant=quant, quant_group_size=group,
                          quant_lm_head=head)
        out[name] = build_engine(cfg).engine_dir
    return out


def _dequantized_checkpoint(model: Path, quant: Quantization, out: Path) -> Path:
    """The float checkpoint with every weight the engine quantizes replaced by its
    dequantized values: transformers on it computes what the engine should, exactly."""
    from runtime.models.sharding import quant_spec_for
    from runtime.store.checkpoint import read_model_config

    cfg, _ = read_model_config(model)
    weights = load_file(str(model / "model.safetensors"))
    for rule in rules_for(cfg):
        spec = quant_spec_for(rule, cfg, quant)
        for src in rule.sources if spec is not None else ():
            weights[src] = quantize(weights[src], spec).dequantize()
    out.mkdir(parents=True)
    for f in model.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _logits(engines: dict[str, Path], names: list[str], tp: int, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"logits-{tp}.json"
    proc = run_mpirun(tp, [sys.executable, "-m", "tests.runtime.mpi_engine_worker", str(out),
                           *(str(engines[n]) for n in names)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    return {n: torch.tensor(result[str(engines[n])]["logits"]) for n in names}


def test_quantized_engines_agree_with_each_other_and_with_transformers(
    engines: dict[str, Path], model: Path, tmp_path: Path
) -> None:
    logits = {}
    for tp in (1, 2):
        logits.update(_logits(engines, [n for n, e in ENGINES.items() if e[1] == tp and not e[5:]],
                              tp, tmp_path))
    # The scheme is in the manifest and the shards hold quantized tensors.
    m = read_manifest(engines["aoti-int4+8-tp1"])
    assert m.quant.linear.kind == "int4" and m.quant.lm_head.kind == "int8"
    shard = load_file(str(engines["aoti-int8+4-tp2"] / "rank1.safetensors"))
    assert shard["layers.0.self_attn.o_proj.qweight"].dtype == torch.int8
    assert shard["lm_head.qweight"].dtype == torch.uint8 and "layers.0.mlp.down_proj.weight" not in shard
    pairs = [("aoti-int4+8-tp1", "eager-int4+8-tp1"), ("aoti-int8+4-tp2", "eager-int8+4-tp2"),
             ("eager-int8-tp1", "eager-int8-tp2"), ("eager-int4-tp1", "eager-int4-tp2")]
    for a, b in pairs:  # compiled kernels vs the reference; TP=1 vs TP=2 (same groups)
        assert rel_err(logits[a], logits[b]) < 1e-4, (a, b, rel_err(logits[a], logits[b]))
    for name in ("eager-int8-tp1", "eager-int4-tp1", "eager-int4g64-tp1", "eager-int4g128-tp1",
                 "aoti-int4+8-tp1", "aoti-int8+4-tp2"):
        quant = read_manifest(engines[name]).quant
        exact = _dequantized_checkpoint(model, quant, tmp_path / f"deq-{name}")
        worst = 0.0
        for row, toks in zip(logits[name], REFERENCE_TOKENS, strict=True):
            assert rel_err(row, last_logits(exact, toks)) < 1e-4, name
            worst = max(worst, rel_err(row, last_logits(model, toks)))
        kinds = {s.kind for s in (quant.linear, quant.lm_head) if s is not None}
        bound = QUANT_ERROR_BOUND["int4_wo" if "int4" in kinds else "int8_wo"]
        assert 0 < worst < bound, (name, worst)
        print(f"{name}: logits within {worst:.2%} of the float model's")


def test_bf16_engines_read_pair_panels_as_the_reference_reads_rows(
    engines: dict[str, Path], tmp_path: Path
) -> None:
    """The compiled bf16 engines against the eager ones (layout-1 rows, W dequantized, cast
    to bf16, F.linear): the kernel keeps W's exact float values and x's requantized to int16,
    so the two differ by bf16 roundings, not by a misread weight."""
    logits = {}
    for tp in (1, 2):
        logits.update(_logits(engines, [n for n, e in ENGINES.items() if e[1] == tp and e[5:]],
                              tp, tmp_path))
    want = weight_layout_for("aoti", "cpu", host_cpu_target().isa, quantized=True)
    for name in ("aoti-bf16-int4+8-tp1", "aoti-bf16-int8+8-tp2"):
        assert read_manifest(engines[name]).weight_layout == want, name
    rows = load_file(str(engines["eager-bf16-int8+8-tp2"] / "rank1.safetensors"))
    ours = load_file(str(engines["aoti-bf16-int8+8-tp2"] / "rank1.safetensors"))
    name = "layers.0.mlp.down_proj.qweight"
    assert torch.equal(ours[name], rows[name]) == (want not in QPANEL_LAYOUTS)
    # rank 1's slice of the vocabulary-parallel int8 head, in pair panels of its own
    assert torch.equal(ours["lm_head.qweight"], rows["lm_head.qweight"]) == (want not in QHEAD_LAYOUTS)
    # The int8 LM head in pair panels as well; the embedding keeps its rows (tied, it has
    # its own copy in the shard), which the lookup reads.
    rows = load_file(str(engines["eager-bf16-int4+8-tp1"] / "rank0.safetensors"))
    ours = load_file(str(engines["aoti-bf16-int4+8-tp1"] / "rank0.safetensors"))
    assert torch.equal(ours["lm_head.qweight"], rows["lm_head.qweight"]) == (want not in QHEAD_LAYOUTS)
    embed = [k for k in rows if k.startswith("embed_tokens.")]
    assert embed and all(torch.equal(ours[k], rows[k]) for k in embed)
    for a, b in (("aoti-bf16-int4+8-tp1", "eager-bf16-int4+8-tp1"),
                 ("aoti-bf16-int8+8-tp2", "eager-bf16-int8+8-tp2")):
        err = rel_err(logits[a], logits[b])
        assert err < 2e-2, (a, b, err)
        print(f"{a}: within {err:.2%} of {b}")


def _runner(engine: Path, weights_hook=None) -> ModelRunner:
    """The engine's rank 0 as the server runs it; `weights_hook` may alter the loaded
    weights first."""
    from runtime.executors.torch import allocate_kv_cache
    from runtime.store.checkpoint import load_engine_model_config

    m = read_manifest(engine)
    cfg: ModelConfig = load_engine_model_config(engine)
    shard = load_shard(engine / "rank0.safetensors")
    if weights_hook is not None:
        weights_hook(shard.weights)
    step = make_step_fn(m.backend, cfg, TPContext(), m.dtype, shard.weights, engine, quant=m.quant)
    bs = m.profile.tokens_per_block
    runner = ModelRunner(step, allocate_kv_cache(cfg, 1, 32, bs, m.dtype), bs)
    runner.keepalive = shard
    return runner


def _observe(engine: Path, rec: dict, weights_hook=None) -> list:
    """The engine's top logits teacher-forced along `rec` (a golden record), one step a
    token, as the warmup gate computes them with --warmup none."""
    _, tops = run_golden(_runner(engine, weights_hook), rec["prompt_token_ids"],
                         len(rec["tokens"]), forced=rec["tokens"])
    return tops


@pytest.mark.parametrize("name", ["aoti-bf16-int4+8-tp1", "aoti-int4+8-tp1"])
def test_the_warmup_gate_checks_each_replay_against_the_build_s_own_run_of_it(
        engines: dict[str, Path], name: str) -> None:
    """The build records the gate's two teacher-forced steps (a prefill of the forced tokens,
    then a decode at the profile's largest batch) beside its greedy run, and the gate checks
    each replay against its own kind, so the deviation is float noise between two runs of
    the same kernels, not between kernel paths chosen by rows: bf16 int4 linears on AMX take
    tiles on bf16 inputs from 8 rows and VNNI passes on int8 inputs below, and SmolLM2's
    int4 engine failed its own gate there (0.47 logits, tolerance 0.433) against the greedy
    record."""
    m = read_manifest(engines[name])
    forced = m.golden["forced"]
    assert forced["decode_batch"] == PROFILE.max_batch_size
    assert len(forced["top_logits"]) == len(m.golden["tokens"])
    for fast, want in ((True, forced), (False, m.golden)):
        tops, ref, _ = replay_golden(_runner(engines[name]), m.golden, PROFILE.max_num_tokens,
                                     PROFILE.max_batch_size, fast=fast)
        assert ref is want
        ok, evidence = check_golden(ref, tops, m.dtype, m.quant.scheme)
        assert ok, evidence
        scale = max(abs(v) for step in ref["top_logits"] for _, v in step)
        worst = max(abs(dict(got)[t] - v) for rec, got in zip(ref["top_logits"], tops)
                    for t, v in rec)
        assert worst <= 1e-3 * scale, (fast, worst, scale)


@pytest.mark.parametrize("name", ["aoti-int4+8-tp1", "eager-int4-tp1"])
def test_the_golden_check_passes_for_the_engine_and_fails_for_a_corrupted_one(
        engines: dict[str, Path], name: str) -> None:
    engine = engines[name]
    m = read_manifest(engine)
    ok, evidence = check_golden(m.golden, _observe(engine, m.golden), m.dtype, m.quant.scheme)
    assert ok and "int4_wo" in evidence, evidence

    def corrupt(w: dict[str, torch.Tensor]) -> None:  # one layer's scales, sign flipped
        w["layers.1.mlp.down_proj.scales"].neg_()

    ok, evidence = check_golden(m.golden, _observe(engine, m.golden, corrupt), m.dtype,
                                m.quant.scheme)
    assert not ok, evidence


def test_the_tolerance_is_tighter_than_the_quantization_error(engines: dict[str, Path]) -> None:
    """A float engine in place of the int4 one fails the int4 engine's golden check: the
    tolerance covers float noise, not quantization error."""
    int4 = read_manifest(engines["eager-int4-tp1"])
    tops = _observe(engines["eager-int8-tp1"], int4.golden)
    ok, evidence = check_golden(int4.golden, tops, int4.dtype, int4.quant.scheme)
    assert not ok, evidence


def test_a_tied_quantized_head_in_pair_panels_has_its_own_packed_copy(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A tied model (the tiny Qwen2, as SmolLM2 and Gemma 3) with --quant-lm-head, compiled
    bf16 for this host: with a QHEAD layout the head reads pair panels while the embedding
    looks rows up, so the two cannot share one tensor. Before the fix the head read the
    embedding's rows as panels: top-1 agreement with transformers fell to 0.8 % (Gemma 3
    270M: mean KL 74 nats) and nothing failed the build."""
    model = tiny_models["qwen2"]
    engine = build_engine(BuildConfig(model=str(model), tp=1, backend="aoti", dtype="bfloat16",
                                      target="cpu", profile=PROFILE, store=str(tmp_path / "s"),
                                      quant="int8_wo", quant_lm_head="int8_wo")).engine_dir
    m = read_manifest(engine)
    shard = load_file(str(engine / "rank0.safetensors"))
    assert "embed_tokens.qweight" in shard
    if m.weight_layout in QHEAD_LAYOUTS:  # the host's bf16 layout packs the head: a copy
        assert shard["lm_head.qweight"].shape == shard["embed_tokens.qweight"].shape
        assert not torch.equal(shard["lm_head.qweight"], shard["embed_tokens.qweight"])
    ours = m.fidelity["engine"]
    assert ours["top1_agreement"] >= 0.9 and ours["mean_kl"] < 1e-3, m.fidelity
