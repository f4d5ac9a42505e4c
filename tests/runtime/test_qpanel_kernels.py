"""aotllm::linear_qpanel (runtime/kernels/qpanel_linear.cpp): quantized weights in pair
panels (runtime/models/panels.py pack_qpanels, the "panels16q" layout) against the torch
reference the eager engines run, compiled for this host as a build would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from contract.quant import QuantSpec
from pipeline.compile.kernels import build_kernels
from runtime import kernels
from runtime.host import host_cpu_target
from runtime.models.panels import pack_qpanel_weight, pack_qpanels, qpanels_fit, unpack_qpanels
from runtime.quant import dequantize_packed, quantize

SPECS = [QuantSpec("int8", 0), QuantSpec("int8", 32), QuantSpec("int4", 32), QuantSpec("int4", 128),
         QuantSpec("int4", 64, zero_point=True), QuantSpec("int4", 32, zero_point=True)]


@pytest.fixture(scope="module")
def lib() -> Path:
    path = build_kernels(host_cpu_target())
    kernels.load(path)
    return path


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_pair_panels_hold_the_same_numbers_in_another_order(spec: QuantSpec) -> None:
    p = quantize(torch.randn(48, 160), spec).packed()
    q, s, m = p["qweight"], p["scales"], p.get("mins")
    pq, ps, pm = pack_qpanels(q, s, m)
    assert (pq.shape, pq.dtype, ps.shape, ps.dtype) == (q.shape, q.dtype, s.shape, s.dtype)
    assert not torch.equal(pq, q)
    uq, us, um = unpack_qpanels(pq, ps, pm)
    assert torch.equal(uq, q) and torch.equal(us, s)
    assert (um is None) == (m is None) and (m is None or torch.equal(um, m))


def int8_runs(x: torch.Tensor) -> torch.Tensor:
    """x as the int4 passes see it (qpanel_vnni.h quantize_runs_i8, qpanel_linear.cpp
    quantize_runs_int8): each run of 32 rounded to int8 steps of its largest |x| / 127, in
    float32."""
    runs = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = runs.abs().amax(-1, keepdim=True)
    # 127 / amax divided as the kernel divides (a scalar over a tensor is a reciprocal times
    # the scalar in torch, one rounding more: a near-tie then rounds the other way)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(runs * inv) * (amax / 127.0)).reshape(x.shape)


def sees_int8_x(spec: QuantSpec, dtype: torch.dtype, rows: int) -> bool:
    """Whether linear_qpanel requantizes x to int8 for this call on this host: int4 weights,
    16-bit x, the integer passes of AVX2 and AVX-512. Not: float32 x and baseline targets
    (W dequantized), AMX hosts' bf16 batches of 8 rows and more (bf16 tiles)."""
    isa = host_cpu_target().isa
    if spec.kind != "int4" or dtype == torch.float32 or isa == "baseline":
        return False
    return not (isa == "amx" and dtype == torch.bfloat16 and rows >= 8)


def sees_bf16_w(spec: QuantSpec, dtype: torch.dtype, rows: int) -> bool:
    """Whether linear_qpanel multiplies bf16 x by each weight dequantized and rounded once to
    bf16 (q x s (+ min)) for this call on this host: AMX tiles from 8 rows (int4) or 16
    (int8) (qpanel_linear.cpp kAmxMinRows4/8, qpanel_amx.h), and int8 weights from 16 rows on
    AVX512-BF16 targets through `vdpbf16ps` (kDpbf16MinRows8, pair_kernel.h)."""
    isa = host_cpu_target().isa
    if dtype != torch.bfloat16:
        return False
    if isa == "amx":
        return rows >= (8 if spec.kind == "int4" else 16)
    return isa == "avx512_bf16" and spec.kind == "int8" and rows >= 16


def int4_reference(x: torch.Tensor, w: torch.Tensor, mins: torch.Tensor | None, group: int,
                   int8_x: bool) -> torch.Tensor:
    """x W^T in float32 as the pair-panel passes compute it: with int8 x, the integer part
    (W less its mins) against x rounded as they round it, the mins' part (min x the run's
    sum of x) against x as given."""
    if not int8_x:
        return torch.nn.functional.linear(x.float(), w)
    m = torch.zeros_like(w) if mins is None else \
        mins.float().repeat_interleave(group, dim=1)[:, : w.shape[1]]
    return torch.nn.functional.linear(int8_runs(x), w - m) + torch.nn.functional.linear(x.float(), m)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (80, 160, True), (48, 1536, True)])
def test_pair_panel_linear_matches_the_reference(lib: Path, spec: QuantSpec, dtype: torch.dtype,
                                                 n: int, k: int, bias: bool) -> None:
    torch.manual_seed(n + k)
    qt = quantize(torch.randn(n, k) / k**0.5, spec)
    p = qt.packed()
    w = dequantize_packed(p["qweight"], p["scales"], p.get("mins"), qt.group, torch.float32)
    q, s, m = pack_qpanels(p["qweight"], p["scales"], p.get("mins"))
    b = torch.randn(n).to(dtype) if bias else None
    # 1-3 rows: one pass of the kernel; 4, 17, 64: several and a short last one; with AMX
    # (bf16, from 8 or 16 rows) 17 pads a tile of rows, 80 takes two groups of tiles
    for rows in (1, 2, 3, 4, 17, 64, 80):
        x = torch.randn(rows, k)
        x[:, ::97] *= 50  # outlier features stretch each run's int16 scale
        x = x.to(dtype)
        got = torch.ops.aotllm.linear_qpanel(x, q, s, m, b, qt.group)
        want = int4_reference(x, w, p.get("mins"), qt.group, sees_int8_x(spec, dtype, rows))
        if b is not None:
            want = want + b.float()
        assert got.dtype == dtype and got.shape == (rows, n)
        # float32: the same products in another order; 16-bit: the output's one rounding
        # (the int16 requantization of x is 2^-16 of a run's largest |x|, far below it; the
        # int8 one is in the reference).
        tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
    x3 = torch.randn(2, 3, k).to(dtype)  # leading dimensions are rows too
    torch.testing.assert_close(torch.ops.aotllm.linear_qpanel(x3, q, s, m, b, qt.group),
                               torch.ops.aotllm.linear_qpanel(x3.reshape(6, k), q, s, m, b,
                                                              qt.group).reshape(2, 3, n))


@pytest.mark.parametrize("spec", [QuantSpec("int8", 32), QuantSpec("int4", 32),
                                  QuantSpec("int4", 64, zero_point=True)], ids=lambda s: s.describe())
def test_an_output_gets_the_same_bits_beside_any_other_rows_and_panels(lib: Path,
                                                                      spec: QuantSpec) -> None:
    """The passes take several rows and (int8) two panels at a time; a row's outputs, and a
    panel's, must not depend on which rows or panels share its pass (speculation verifies k
    tokens in one call and must match plain decode bit for bit). Row counts stay below the
    AMX thresholds (8 rows int4, 16 int8), where an AMX host switches kernels by design."""
    if host_cpu_target().isa == "baseline":
        pytest.skip("baseline targets have no passes: W is dequantized for at::linear's GEMM")
    torch.manual_seed(7)
    n, k = 80, 576  # 5 panels: two pairs and one alone; drop the first and each pairs anew
    p = quantize(torch.randn(n, k) / k**0.5, spec).packed()
    q, s, m = p["qweight"], p["scales"], p.get("mins")
    full = pack_qpanels(q, s, m)
    less = pack_qpanels(q[16:].contiguous(), s[16:].contiguous(), None if m is None else m[16:].contiguous())
    rows = 7 if spec.kind == "int4" else 15
    x = torch.randn(rows, k)
    x[:, ::97] *= 50
    x = x.to(torch.bfloat16)
    # float32 out (the LM head's logits): bf16 out would round most differences away
    together = torch.ops.aotllm.linear_qpanel(x, *full, None, spec.group_size, True)
    for r in range(rows):
        alone = torch.ops.aotllm.linear_qpanel(x[r : r + 1], *full, None, spec.group_size, True)
        assert torch.equal(alone[0], together[r]), r
    shifted = torch.ops.aotllm.linear_qpanel(x, *less, None, spec.group_size, True)
    assert torch.equal(shifted, together[:, 16:])


def test_a_shard_packs_only_what_fits_and_the_layer_agrees() -> None:
    spec = QuantSpec("int4", 32)
    shard = {}
    for name, (n, k) in {"fits": (32, 64), "short": (24, 64)}.items():
        p = quantize(torch.randn(n, k), spec).packed()
        shard |= {f"{name}.qweight": p["qweight"], f"{name}.scales": p["scales"]}
    before = {k: v.clone() for k, v in shard.items()}
    for name in ("fits", "short"):
        pack_qpanel_weight(shard, name, spec)
    assert qpanels_fit(32, 64, 32) and not torch.equal(shard["fits.qweight"], before["fits.qweight"])
    assert not qpanels_fit(24, 64, 32) and torch.equal(shard["short.qweight"], before["short.qweight"])
    assert not qpanels_fit(32, 48, 48)  # a group of 48 splits a run of 32


def test_bad_shapes_are_errors_not_garbage(lib: Path) -> None:
    p = quantize(torch.randn(32, 64), QuantSpec("int4", 32)).packed()
    q, s, _ = pack_qpanels(p["qweight"], p["scales"], None)
    with pytest.raises(RuntimeError, match="x's last dimension must be K"):
        torch.ops.aotllm.linear_qpanel(torch.randn(1, 96), q, s, None, None, 32)
    with pytest.raises(RuntimeError, match="pair panels need"):
        torch.ops.aotllm.linear_qpanel(torch.randn(1, 64), q[:24], s[:24], None, None, 32)
    with pytest.raises(RuntimeError, match="mins: int4 only"):
        torch.ops.aotllm.linear_qpanel(torch.randn(1, 64), q, s, s[:, :1].contiguous(), None, 32)


def test_amx_tiles_and_onednn_share_threads(lib: Path) -> None:
    """Our AMX passes (bf16 batches, where the host has AMX) load their tile configuration
    per call and release it; oneDNN's bf16 GEMMs on the same threads load theirs. Interleaved,
    each keeps giving the same numbers (a stale configuration would change them or fault)."""
    torch.manual_seed(3)
    qt = quantize(torch.randn(1024, 576) / 24, QuantSpec("int4", 32))
    p = qt.packed()
    q, s, _ = pack_qpanels(p["qweight"], p["scales"], None)
    w2 = torch.randn(512, 576).to(torch.bfloat16)
    x = torch.randn(96, 576).to(torch.bfloat16)
    counts = (8, 17, 40, 64, 96)  # each path's row counts (the paths differ in rounding)
    want_a = torch.nn.functional.linear(x, w2)
    want_b = {n: torch.ops.aotllm.linear_qpanel(x[:n], q, s, None, None, 32) for n in counts}
    for i in range(40):
        rows = counts[i % len(counts)]
        assert torch.equal(torch.nn.functional.linear(x, w2), want_a), i
        assert torch.equal(torch.ops.aotllm.linear_qpanel(x[:rows], q, s, None, None, 32),
                           want_b[rows]), i
