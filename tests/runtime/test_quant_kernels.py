"""aotllm::linear_int8 / linear_int4 (runtime/kernels/quant_linear.cpp) against the torch
reference the eager engines run (runtime/quant.py: dequantize in float32, cast, F.linear),
compiled for this host as a build would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from contract.quant import QuantSpec
from pipeline.compile.kernels import build_kernels
from runtime import kernels
from runtime.host import host_cpu_target
from runtime.quant import dequantize_packed, quantize, runs_here

SPECS = [QuantSpec("int8", 0), QuantSpec("int8", 32), QuantSpec("int4", 32), QuantSpec("int4", 128),
         QuantSpec("int4", 64, zero_point=True)]


@pytest.fixture(scope="module")
def lib() -> Path:
    path = build_kernels(host_cpu_target())
    kernels.load(path)
    return path


def _op(x: torch.Tensor, p: dict[str, torch.Tensor], b: torch.Tensor | None, group: int,
        kind: str) -> torch.Tensor:
    if kind == "int8":
        return torch.ops.aotllm.linear_int8(x, p["qweight"], p["scales"], b, group)
    return torch.ops.aotllm.linear_int4(x, p["qweight"], p["scales"], p.get("mins"), b, group)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (70, 160, True), (33, 1536, True)])
def test_quantized_linear_matches_the_reference(lib: Path, spec: QuantSpec, dtype: torch.dtype,
                                                n: int, k: int, bias: bool) -> None:
    torch.manual_seed(n + k)
    qt = quantize(torch.randn(n, k) / k**0.5, spec)
    p = qt.packed()
    w = dequantize_packed(p["qweight"], p["scales"], p.get("mins"), qt.group, dtype).float()
    b = torch.randn(n).to(dtype) if bias else None
    # decode rows (weights streamed), batches of 5-16 (integer rows for 16-bit inputs on AVX2,
    # in passes of 8; dequantized panels for float32), 17 and prefill (panels; at K = 1536 in
    # chunks of K)
    for m in (1, 3, 5, 8, 16, 17, 64):
        x = torch.randn(m, k).to(dtype)
        got = _op(x, p, b, qt.group, spec.kind)
        want = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
        assert got.dtype == dtype and got.shape == (m, n)
        # float32: the same products summed in another order; bf16/fp16: one output rounding.
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_decode_rows_of_16_bit_inputs_lose_nothing_but_the_output_rounding(
        lib: Path, spec: QuantSpec) -> None:
    """Decode rows (M <= 16) of float16 inputs: on AVX2 x is requantized to int16 per run of
    32 for integer dot products (int8 and int4 weights). Its error must stay far below the float16 output's own
    rounding (2^-11 relative), with outliers in x (a few features 50x the rest, as LLM
    activations have) that stretch each run's scale."""
    torch.manual_seed(7)
    n, k = 300, 576
    qt = quantize(torch.randn(n, k) / k**0.5, spec)
    p = qt.packed()
    w = dequantize_packed(p["qweight"], p["scales"], p.get("mins"), qt.group, torch.float32)
    for m in (1, 2, 4, 5, 8, 9, 16):  # 9 and 16: a second pass of 8 rows over each weight row
        x = torch.randn(m, k)
        x[:, ::97] *= 50
        x = x.half()
        want = torch.nn.functional.linear(x.float(), w)
        got = _op(x, p, None, qt.group, spec.kind).float()
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, atol=2e-4 * scale, rtol=1e-3)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_the_kernels_dequantize_exactly_as_the_reference(lib: Path, spec: QuantSpec) -> None:
    qt = quantize(torch.randn(64, 256), spec)
    p = qt.packed()
    bits = 4 if spec.kind == "int4" else 8
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.ops.aotllm.dequantize(p["qweight"], p["scales"], p.get("mins"), 256, qt.group,
                                          bits, dtype)
        assert torch.equal(got, dequantize_packed(p["qweight"], p["scales"], p.get("mins"),
                                                  qt.group, dtype))


def test_int8_rows_of_any_length_take_the_portable_loops(lib: Path) -> None:
    qt = quantize(torch.randn(40, 100), QuantSpec("int8", 0))  # K % 32 != 0: no vector path
    p = qt.packed()
    x = torch.randn(2, 100)
    want = x @ qt.dequantize().T
    torch.testing.assert_close(torch.ops.aotllm.linear_int8(x, p["qweight"], p["scales"], None, 100),
                               want, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_errors_not_garbage(lib: Path) -> None:
    p = quantize(torch.randn(8, 64), QuantSpec("int4", 32)).packed()
    with pytest.raises(RuntimeError, match="do not fit groups"):
        torch.ops.aotllm.linear_int4(torch.randn(1, 64), p["qweight"], p["scales"], None, None, 64)
    with pytest.raises(RuntimeError, match="does not fit inputs"):
        torch.ops.aotllm.linear_int4(torch.randn(1, 96), p["qweight"], p["scales"], None, None, 32)
    with pytest.raises(RuntimeError, match="split a packed run"):
        torch.ops.aotllm.linear_int4(torch.randn(1, 64), p["qweight"], p["scales"], None, None, 48)


def test_the_compatible_gate_says_what_runs_a_quantized_engine() -> None:
    from contract.quant import NONE, Quantization

    q = Quantization("int4_wo", QuantSpec("int4", 32))
    assert runs_here(NONE, "aoti", "cpu", False) == (True, "none")
    ok, why = runs_here(q, "aoti", "cpu", True)
    assert ok and "aotllm::linear_int4" in why
    ok, why = runs_here(q, "aoti", "cpu", True, "panels16q")
    assert ok and "aotllm::linear_qpanel (int4 pair panels)" in why
    headed = Quantization("int4_wo", QuantSpec("int4", 32), QuantSpec("int8", 0))
    ok, why = runs_here(headed, "aoti", "cpu", True, "panels16qh")
    assert ok and "aotllm::linear_qpanel (int4 pair panels and LM head)" in why
    ok, why = runs_here(q, "aoti", "cpu", False)
    assert not ok and "no kernels library" in why
    ok, why = runs_here(Quantization("fp8"), "eager", "cpu", False)
    assert not ok and "only TensorRT-LLM runs" in why
