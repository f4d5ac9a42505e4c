"""The LM head's `float_out` (float32 logits, as TensorRT-LLM's `logits_dtype`): every linear
kernel an LM head can take returns float32 sums of the bf16 (or float16) operands, never
rounded to the model dtype, for decode rows, batches and prompt rows; compiled for this
host's ISA level (or AOTLLM_CPU_ISA's, tests/runtime/test_isa_levels.py runs it so)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from contract.quant import QuantSpec
from pipeline.compile.kernels import build_kernels
from runtime import kernels
from runtime.host import host_cpu_target
from runtime.models.panels import pack_pairs, pack_panels, pack_qpanels
from runtime.quant import dequantize_packed, quantize
from tests.runtime.test_qpanel_kernels import int4_reference, sees_bf16_w, sees_int8_x

ROWS = (1, 3, 4, 5, 16, 17, 67)  # decode rows, passes of 4 and a short one, batches, prompts


@pytest.fixture(scope="module")
def lib() -> Path:
    path = build_kernels(host_cpu_target())
    kernels.load(path)
    return path


def _float_ops(w: torch.Tensor) -> dict[str, Callable[..., torch.Tensor]]:
    a = torch.ops.aotllm
    panels, pairs = pack_panels(w), pack_pairs(w)
    return {"rows": lambda x, b, f: a.linear(x, w, b, f),
            "panels16": lambda x, b, f: a.linear_panel(x, panels, b, f),
            "pairs16": lambda x, b, f: a.linear_pairs(x, pairs, b, f)}


def _check(got: torch.Tensor, rounded: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == torch.float32 and rounded.dtype == dtype and got.shape == want.shape
    # float32 sums in another order (and, for 16-bit x on some ISAs, x requantized per run:
    # 2^-16 of a run's largest |x|), far inside one bf16 rounding of the output ...
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=2e-5 * scale, rtol=1e-5)
    # ... which the same op without float_out does apply: the two differ
    assert torch.equal(rounded, got.to(dtype)) or (rounded.float() - got).abs().max() < 1e-2 * scale
    assert not torch.equal(got, got.to(dtype).float()), "float_out came back rounded"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["rows", "panels16", "pairs16"])
def test_float_linears_return_unrounded_float32_logits(lib: Path, dtype: torch.dtype,
                                                       layout: str) -> None:
    torch.manual_seed(7)
    n, k = 320, 576
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype)
    op = _float_ops(w)[layout]
    for rows in ROWS:
        x = (4 * torch.randn(rows, k)).to(dtype)
        for bias in (None, b):
            want = torch.nn.functional.linear(x.float(), w.float(),
                                              None if bias is None else bias.float())
            _check(op(x, bias, True), op(x, bias, False), want, dtype)


SPECS = [QuantSpec("int8", 32), QuantSpec("int4", 32), QuantSpec("int4", 64, zero_point=True)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("layout", ["rows", "pairs"])
def test_quantized_heads_return_unrounded_float32_logits(lib: Path, spec: QuantSpec,
                                                         layout: str) -> None:
    torch.manual_seed(11)
    n, k, dtype = 320, 576, torch.bfloat16
    qt = quantize(torch.randn(n, k) / k**0.5, spec)
    p = qt.packed()
    q, s, m = p["qweight"], p["scales"], p.get("mins")
    # the weights as each kernel sees them: the row-major kernels round the dequantized
    # weights to the model dtype as the eager reference does, but for AVX2's float32 GEMV
    # and panels; the pair-panel passes keep scale * q exact
    rounds = layout == "rows" and host_cpu_target().isa != "avx2"
    w = dequantize_packed(q, s, m, qt.group, dtype if rounds else torch.float32).float()
    # AMX tiles (pairs, bf16 batches) take each weight rounded once to bf16
    w16 = dequantize_packed(q, s, m, qt.group, dtype).float()
    a = torch.ops.aotllm
    if layout == "pairs":
        pq, ps, pm = pack_qpanels(q, s, m)

        def op(x: torch.Tensor, f: bool) -> torch.Tensor:
            return a.linear_qpanel(x, pq, ps, pm, None, qt.group, f)
    else:
        def op(x: torch.Tensor, f: bool) -> torch.Tensor:
            if spec.kind == "int8":
                return a.linear_int8(x, q, s, None, qt.group, f)
            return a.linear_int4(x, q, s, m, None, qt.group, f)
    for rows in ROWS:
        x = (4 * torch.randn(rows, k)).to(dtype)
        int8_x = layout == "pairs" and sees_int8_x(spec, dtype, rows)
        tiles = layout == "pairs" and sees_bf16_w(spec, dtype, rows)
        want = int4_reference(x, w16 if tiles else w, m, qt.group, int8_x)
        got = op(x, True)
        assert got.dtype == torch.float32
        # the pair-panel passes requantize x to int16 per run of 32 (2^-16 of its largest |x|,
        # times the mins' sums with a zero point): 1e-4 of the range, a bf16 rounding 4e-3;
        # where they take int8 x, the reference rounds x as they do
        torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)
        assert not torch.equal(got, got.to(dtype).float()), "float_out came back rounded"
        assert op(x, False).dtype == dtype
