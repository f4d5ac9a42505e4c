"""aotllm::linear_pairs (runtime/kernels/pair_linear.cpp): float weights in pair panels (the
"pairs16" layout of bf16 engines on AMX targets, runtime/models/panels.py pack_pairs) against
F.linear on the row-major weights, compiled for this host as a build would: AMX tiles where
the host has them, `vdpbf16ps` on AVX512-BF16, plain loops elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.compile.kernels import build_kernels
from runtime import kernels
from runtime.host import host_cpu_target
from runtime.models.layers import ColumnParallelLinear
from runtime.models.panels import pack_pairs, pairs_fit, unpack_pairs
from runtime.models.parallel import TPContext


@pytest.fixture(scope="module")
def lib() -> Path:
    path = build_kernels(host_cpu_target())
    kernels.load(path)
    return path


def test_pairs_pack_and_unpack_exactly() -> None:
    w = torch.randn(48, 96)
    p = pack_pairs(w)
    assert p.shape == w.shape and not torch.equal(p, w)
    assert torch.equal(unpack_pairs(p), w)
    # element (n, k) at 16pK + 32t + 2j + k % 2 (panel p = n // 16, pair t = k // 2, j = n % 16)
    flat = p.reshape(-1)
    for n, k in ((0, 0), (5, 3), (37, 95), (16, 1)):
        assert flat[(n // 16) * 16 * 96 + (k // 2) * 32 + (n % 16) * 2 + k % 2] == w[n, k]
    assert pairs_fit(48, 96) and not pairs_fit(40, 96) and not pairs_fit(48, 80)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (48, 1536, True), (32, 64, True)])
def test_pair_linear_matches_f_linear(lib: Path, dtype: torch.dtype, n: int, k: int,
                                      bias: bool) -> None:
    torch.manual_seed(n + k)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    wp = pack_pairs(w)
    # vdpbf16ps: 1-4 rows four panels a pass, 5-8 two, 9 and 12 two even passes, 16 two of
    # 8 (the second prefetching the next panel pair), 17 three; 48 columns end on a single
    # panel. AMX: 1-16 rows one tile of rows over four panels (960 columns: 60 panels, 48: three
    # one at a time), 17 pads two tiles of rows, 64 fills four, 80 takes two groups of tiles
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 64, 80):
        x = torch.randn(rows, k).to(dtype)
        got = torch.ops.aotllm.linear_pairs(x, wp, b)
        want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.dtype == dtype and got.shape == (rows, n)
        # float32 sums of the same products in another order; 16-bit: the output's rounding
        tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
    x3 = torch.randn(2, 3, k).to(dtype)  # leading dimensions are rows too
    torch.testing.assert_close(torch.ops.aotllm.linear_pairs(x3, wp, b),
                               torch.ops.aotllm.linear_pairs(x3.reshape(6, k), wp, b).reshape(2, 3, n))


def test_a_layer_takes_pairs_only_where_its_shape_fits(lib: Path) -> None:
    tp = TPContext(use_kernels=True)
    fits = ColumnParallelLinear(64, 32, False, tp, torch.bfloat16, panels="pairs16")
    short = ColumnParallelLinear(64, 24, False, tp, torch.bfloat16, panels="pairs16")
    assert fits.pairs and not short.pairs  # the build leaves a weight that does not fit in rows
    w = torch.randn(32, 64).to(torch.bfloat16)
    fits.weight.data = pack_pairs(w)
    x = torch.randn(3, 64).to(torch.bfloat16)
    torch.testing.assert_close(fits(x).float(), torch.nn.functional.linear(x.float(), w.float()),
                               atol=1e-2, rtol=1e-2)


def test_bad_shapes_are_errors_not_garbage(lib: Path) -> None:
    w = pack_pairs(torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="pair panels"):
        torch.ops.aotllm.linear_pairs(torch.randn(1, 96).to(torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="pair panels"):
        torch.ops.aotllm.linear_pairs(torch.randn(1, 64).to(torch.bfloat16), w[:24], None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.aotllm.linear_pairs(torch.randn(1, 64), w, None)


def test_amx_tiles_of_both_kernels_and_onednn_share_threads(lib: Path) -> None:
    """The bf16 pair kernel and oneDNN's GEMMs on the same threads, interleaved: each loads
    its own tile configuration, and each keeps giving the same numbers."""
    torch.manual_seed(5)
    w = torch.randn(512, 576).to(torch.bfloat16)
    wp = pack_pairs(w)
    x = torch.randn(40, 576).to(torch.bfloat16)
    want_a = torch.nn.functional.linear(x, w)
    want_b = {n: torch.ops.aotllm.linear_pairs(x[:n], wp, None) for n in (1, 16, 40)}
    for i in range(30):
        rows = (1, 16, 40)[i % 3]
        assert torch.equal(torch.nn.functional.linear(x, w), want_a), i
        assert torch.equal(torch.ops.aotllm.linear_pairs(x[:rows], wp, None), want_b[rows]), i


def test_a_rows_sums_do_not_depend_on_the_rows_beside_it(lib: Path) -> None:
    # A verify step (speculation) multiplies a sequence's rows together with others, plain
    # decode one at a time: their logits must agree bit for bit, so a row's result may not
    # depend on how many rows share its pass (or how the passes split them).
    torch.manual_seed(3)
    w = (torch.randn(96, 576) / 24).to(torch.bfloat16)
    wp = pack_pairs(w)
    x = torch.randn(17, 576).to(torch.bfloat16)
    alone = torch.cat([torch.ops.aotllm.linear_pairs(x[i:i + 1], wp, None, True) for i in range(17)])
    # 96 columns: six panels, a group of four and two left (vdpbf16ps and AMX alike)
    for rows in (2, 3, 4, 5, 8, 9, 12, 16, 17):
        assert torch.equal(torch.ops.aotllm.linear_pairs(x[:rows], wp, None, True), alone[:rows])
