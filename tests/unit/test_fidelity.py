"""pipeline/fidelity.py: the build records how far the engine is from transformers float32
on a fixed text, beside transformers' own 16-bit figures, and refuses a 16-bit engine that
drifts further than 1.5x transformers' own drift."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from contract.errors import BuildError
from contract.profile import BuildProfile
from pipeline.build import build_engine
from pipeline.config import BuildConfig
from pipeline.fidelity import compare, describe, judge

PROFILE = BuildProfile(max_batch_size=2, max_num_tokens=32, max_seq_len=64, tokens_per_block=4)


def test_compare_measures_delta_kl_and_agreement() -> None:
    torch.manual_seed(0)
    ref = torch.log_softmax(torch.randn(5, 40) * 3, -1)
    ids = [0, *ref.argmax(-1).tolist()]
    same = compare(ref, ref, ids)
    assert same == {"mean_abs_dlogprob": 0.0, "mean_kl": 0.0, "top1_agreement": 1.0}
    # logits rounded to bf16 at a large offset (as an LM head that rounds its output)
    rounded = torch.log_softmax(((ref + 25).bfloat16().float()), -1)
    got = compare(ref, rounded, ids)
    assert got["mean_kl"] > 0 and got["mean_abs_dlogprob"] > 1e-3


def _record(ours_kl: float, own_kl: float) -> dict:
    f = lambda kl: {"mean_abs_dlogprob": 0.02, "mean_kl": kl, "top1_agreement": 1.0}  # noqa: E731
    return {"reference": "transformers float32", "tokens": 89, "engine": f(ours_kl),
            "transformers_bfloat16": f(own_kl)}


def test_a_16_bit_engine_further_than_transformers_own_drift_fails() -> None:
    # SmolLM2 bf16 measured: ours 0.000321 against transformers' 0.000983
    assert judge(_record(0.000321, 0.000983), "bfloat16", quantized=False) == ""
    verdict = judge(_record(0.0016, 0.000983), "bfloat16", quantized=False)
    assert "mean KL 0.0016 against 0.000983" in verdict
    # quantized engines: recorded, never judged; below the floor both are noise
    assert judge(_record(0.5, 0.000983), "bfloat16", quantized=True) == ""
    # ... except garbage, quantized or float32 (no reference dtype): not the model
    for quantized, dtype in ((True, "bfloat16"), (False, "float32")):
        verdict = judge(_record(74.9, 0.000983), dtype, quantized=quantized)
        assert "not the model" in verdict and "74.9" in verdict
    assert judge(_record(9e-5, 1e-6), "bfloat16", quantized=False) == ""
    assert "engine: KL 0.000321" in describe(_record(0.000321, 0.000983))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_build_records_its_fidelity(tiny_models: dict[str, Path], tmp_path: Path,
                                      dtype: str) -> None:
    cfg = BuildConfig(model=str(tiny_models["llama"]), tp=1, backend="eager", dtype=dtype,
                      target="cpu", profile=PROFILE, store=str(tmp_path))
    result = build_engine(cfg)
    fid = result.manifest.fidelity
    assert fid["reference"] == "transformers float32" and fid["tokens"] == 32
    assert not (result.engine_dir / ".fidelity.pt").exists()
    eng = fid["engine"]
    if dtype == "float32":  # the same arithmetic as transformers, another order
        assert eng["mean_kl"] < 1e-8 and eng["top1_agreement"] == 1.0
        assert "transformers_float32" not in fid
    else:
        assert fid["transformers_bfloat16"]["mean_kl"] > 0
        assert judge(fid, dtype, quantized=False) == ""


def test_logits_rounded_to_bf16_fail_the_build_with_the_numbers(
        tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old LM head: its logits rounded to bf16 (simulated at SmolLM2's logit scale, 25,
    where a bf16 step is 1/8) on top of the engine's own arithmetic."""
    import pipeline.fidelity as fidelity
    import runtime.executors.golden as golden

    real = golden.run_logprobs
    monkeypatch.setattr(golden, "run_logprobs", lambda *a, **k: torch.log_softmax(
        (real(*a, **k) + 25).bfloat16().float(), -1))
    monkeypatch.setattr(fidelity, "KL_FLOOR", 0.0)  # the tiny model's figures are small
    cfg = BuildConfig(model=str(tiny_models["llama"]), tp=1, backend="eager", dtype="bfloat16",
                      target="cpu", profile=PROFILE, store=str(tmp_path))
    with pytest.raises(BuildError, match="further from transformers float32 than transformers' "
                                         "own bfloat16 is: mean KL"):
        build_engine(cfg)
