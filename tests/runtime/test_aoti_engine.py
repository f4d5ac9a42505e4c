"""A compiled (aoti) TP=2 engine computes what the eager engine and transformers compute,
in float32 and in bf16 (whose linears an AMX host's build stores in pair panels)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contract.layout import FLOAT_PAIR_LAYOUTS, FLOAT_PANEL_LAYOUTS, weight_layout_for
from contract.manifest import read_manifest
from contract.profile import BuildProfile
from pipeline.build import build_engine
from pipeline.config import BuildConfig
from runtime.host import host_cpu_target
from runtime.models.panels import unpack_pairs, unpack_panels
from tests.conftest import run_mpirun
from tests.runtime.hf_reference import last_logits, rel_err
from tests.runtime.mpi_engine_worker import REFERENCE_TOKENS

PROFILE = BuildProfile(max_batch_size=4, max_num_tokens=32, max_seq_len=64, tokens_per_block=4)


@pytest.fixture(scope="session")
def tiny_tp2_engines(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    store = tmp_path_factory.mktemp("engines")
    out = {}
    # bf16 also on qwen2: a tied embedding (one tensor, the LM head's) and qkv biases
    for name, model, dtype in (("", "llama_kv3", "float32"), ("-bf16", "llama_kv3", "bfloat16"),
                               ("-bf16-tied", "qwen2", "bfloat16")):
        for backend in ("aoti", "eager"):
            cfg = BuildConfig(model=str(tiny_models[model]), tp=2, backend=backend, dtype=dtype,
                              target="cpu", profile=PROFILE, store=str(store))
            out[backend + name] = build_engine(cfg).engine_dir
    return out


def test_aoti_tp2_engine_matches_eager_and_transformers(
    tiny_tp2_engines: dict[str, Path], tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    aoti, eager = tiny_tp2_engines["aoti"], tiny_tp2_engines["eager"]
    assert (aoti / "rank0.pt2").is_file() and (aoti / "rank1.pt2").is_file()
    # On an AVX2 / AVX-512F host the aoti build stores the linears in panels (so this test
    # checks the panel kernel); the eager engine keeps them row-major.
    host = host_cpu_target()
    assert read_manifest(aoti).weight_layout == weight_layout_for("aoti", "cpu", host.isa,
                                                                  dtype="float32")
    assert read_manifest(eager).weight_layout == "rows"
    # 3 KV heads over 2 ranks (runtime/models/kv_heads.py): the middle one on both ranks,
    # attended by rank 0 at even positions and by rank 1 at odd ones
    rows = [load_file(str(aoti / f"rank{r}.safetensors"))["kv_head_rows"].tolist() for r in (0, 1)]
    assert rows == [[[1, 0, 1], [2, 0, 1]], [[2, 1, 2], [1, 0, 1]]]
    out = tmp_path / "logits.json"
    proc = run_mpirun(2, [sys.executable, "-m", "tests.runtime.mpi_engine_worker", str(out), str(aoti), str(eager)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    la, le = (torch.tensor(result[str(p)]["logits"]) for p in (aoti, eager))
    assert la.shape == le.shape == (len(REFERENCE_TOKENS), 256)
    for row_a, row_e, toks in zip(la, le, REFERENCE_TOKENS):
        assert rel_err(row_a, row_e) < 1e-4
        assert rel_err(row_a, last_logits(tiny_models["llama_kv3"], toks)) < 1e-4


def test_aoti_bf16_tp2_engine_matches_eager(tiny_tp2_engines: dict[str, Path], tmp_path: Path) -> None:
    """bf16: on an AMX host the build stores the linears and the LM head in pair panels
    (aotllm::linear_pairs multiplies them as AMX tiles), on AVX2/AVX-512F in panels, on
    AVX512-BF16 in rows; the compiled engine then differs from the eager one (rows, F.linear)
    by bf16 roundings only, and both return float32 logits."""
    want = weight_layout_for("aoti", "cpu", host_cpu_target().isa, dtype="bfloat16")
    # the tiny models' shapes fit whole panels and pair runs: every float linear and the LM
    # head are packed where the layout packs them (AVX2/AVX-512F: panels; AMX: pairs)
    unpack = (unpack_pairs if want in FLOAT_PAIR_LAYOUTS
              else unpack_panels if want in FLOAT_PANEL_LAYOUTS else lambda w: w)
    e = tiny_tp2_engines
    assert read_manifest(e["aoti-bf16"]).weight_layout == want
    ours, rows = (load_file(str(x / "rank1.safetensors")) for x in (e["aoti-bf16"], e["eager-bf16"]))
    for name in ("layers.0.mlp.down_proj.weight", "lm_head.weight"):
        assert torch.equal(ours[name], rows[name]) == (want == "rows"), name
        assert torch.equal(unpack(ours[name]), rows[name]), name
    assert torch.equal(ours["embed_tokens.weight"], rows["embed_tokens.weight"])  # untied: rows
    # tied: the embedding is the head's one tensor, in its layout; the lookup reads it so
    ours, rows = (load_file(str(x / "rank1.safetensors"))
                  for x in (e["aoti-bf16-tied"], e["eager-bf16-tied"]))
    assert "lm_head.weight" not in ours
    assert torch.equal(unpack(ours["embed_tokens.weight"]), rows["embed_tokens.weight"])
    for kind in ("bf16", "bf16-tied"):
        aoti, eager = e[f"aoti-{kind}"], e[f"eager-{kind}"]
        out = tmp_path / f"logits-{kind}.json"
        proc = run_mpirun(2, [sys.executable, "-m", "tests.runtime.mpi_engine_worker", str(out),
                              str(aoti), str(eager)])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = json.loads(out.read_text())
        la, le = (torch.tensor(result[str(p)]["logits"]) for p in (aoti, eager))
        err = rel_err(la, le)
        assert err < 2e-2, (kind, err)
        print(f"aoti {kind} TP=2 ({want}) within {err:.2%} of eager")
