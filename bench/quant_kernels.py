"""Quantized GEMM kernels for SmolLM2-135M's 30 decoder layers, side by side.

    python -m bench.quant_kernels [--threads 2] [--rows 1 4 16 64] [--repeat 7]

For each row count M (1: one decode sequence, 16: a full decode batch, 64+: prefill) the
time of all 30 layers' four linears (qkv, o, gate_up, down; 3.5 M weights a layer) with:
bf16 at::linear (oneDNN), our bf16 GEMV (aotllm::linear), torch's CPU int8 kernel
(aten._weight_int8pack_mm, per channel), torch's CPU int4 kernel
(aten._weight_int4pack_mm_for_cpu, groups of --group, 64 by default: it needs K % G == 0), and ours
(aotllm::linear_int8 / linear_int4 on layout-1 rows; linear_qpanel on the pair panels of
the "panels16q" layout; bf16 aotllm::linear_panel on panels16). GB/s counts the weight
bytes each reads once.
Interleaved repeats, best of each: other work on these 2 cores only ever slows a run down.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from contract.quant import QuantSpec
from runtime.models.panels import pack_panels, pack_qpanels
from runtime.quant import quantize

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K): qkv, o, gate_up, down
LAYERS = 30


def _load_kernels() -> None:
    from pipeline.compile.kernels import build_kernels
    from runtime import kernels
    from runtime.host import host_cpu_target

    kernels.load(build_kernels(host_cpu_target()))


def _layers(group: int) -> list[dict[str, object]]:
    torch.manual_seed(0)
    out = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = torch.randn(n, k) / k**0.5
            i8 = quantize(w, QuantSpec("int8", 0)).packed()
            i4 = quantize(w, QuantSpec("int4", group))
            p4 = i4.packed()
            # torch's int4 CPU format: int32 [N, K] values 0..15, scale/zero bf16 [K/G, N, 2]
            # with w = (q - 8) * scale + zero.
            packed = torch._convert_weight_to_int4pack_for_cpu(i4.q.to(torch.int32), 1)
            sz = torch.stack((i4.scales.float().T, torch.zeros_like(i4.scales.float().T)), -1)
            pairs = {name: dict(zip(("qweight", "scales"), pack_qpanels(
                p["qweight"], p["scales"], None)[:2])) for name, p in (("i8p", i8), ("i4p", p4))}
            out.append({
                **pairs, "bf16p": pack_panels(w.to(torch.bfloat16)),
                "n": n, "k": k, "bf16": w.to(torch.bfloat16), "i8": i8,
                "i8_scale_bf16": i8["scales"].reshape(-1).to(torch.bfloat16), "i4": p4,
                "tq": packed, "tsz": sz.to(torch.bfloat16).contiguous(),
            })
    return out


def _variants(group: int) -> dict[str, tuple[Callable[[torch.Tensor, dict], torch.Tensor], str]]:
    ops = torch.ops.aotllm
    return {
        "bf16 at::linear": (lambda x, L: torch.nn.functional.linear(x, L["bf16"]), "bf16"),
        "bf16 aotllm::linear": (lambda x, L: ops.linear(x, L["bf16"], None), "bf16"),
        "bf16 aotllm::linear_panel": (lambda x, L: ops.linear_panel(x, L["bf16p"], None), "bf16"),
        "int8 aten._weight_int8pack_mm": (
            lambda x, L: torch._weight_int8pack_mm(x, L["i8"]["qweight"], L["i8_scale_bf16"]), "i8"),
        "int8 aotllm::linear_int8": (
            lambda x, L: ops.linear_int8(x, L["i8"]["qweight"], L["i8"]["scales"], None, L["k"]), "i8"),
        "int8 aotllm::linear_qpanel": (
            lambda x, L: ops.linear_qpanel(x, L["i8p"]["qweight"], L["i8p"]["scales"], None, None,
                                           L["k"]), "i8p"),
        f"int4 g{group} aten._weight_int4pack_mm_for_cpu": (
            lambda x, L: torch._weight_int4pack_mm_for_cpu(x, L["tq"], group, L["tsz"]), "i4"),
        f"int4 g{group} aotllm::linear_int4": (
            lambda x, L: ops.linear_int4(x, L["i4"]["qweight"], L["i4"]["scales"], None, None,
                                         group), "i4"),
        f"int4 g{group} aotllm::linear_qpanel": (
            lambda x, L: ops.linear_qpanel(x, L["i4p"]["qweight"], L["i4p"]["scales"], None, None,
                                           group), "i4p"),
    }


def _bytes(layers: list[dict], kind: str) -> int:
    total = 0
    for L in layers:
        if kind == "bf16":
            total += L["bf16"].numel() * 2
        else:
            p = L[kind]
            total += sum(t.numel() * t.element_size() for t in p.values())
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--group", type=int, default=64, help="int4 group (aten needs K %% G == 0)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    _load_kernels()
    layers = _layers(args.group)
    variants = _variants(args.group)
    print(f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}, "
          f"{args.threads} threads, pid {os.getpid()}")
    print("| M | kernel | ms (30 layers) | weight GB/s |")
    print("|---|---|---|---|")
    for m in args.rows:
        x = torch.randn(m, 1536).to(torch.bfloat16)
        xs = {k: x[:, :k].contiguous() for k in {L["k"] for L in layers}}
        best = {name: float("inf") for name in variants}
        for _ in range(args.repeat):
            for name, (fn, _) in variants.items():
                t0 = time.perf_counter()
                with torch.inference_mode():
                    for L in layers:
                        fn(xs[L["k"]], L)
                best[name] = min(best[name], time.perf_counter() - t0)
        for name, (_, kind) in variants.items():
            gbps = _bytes(layers, kind) / best[name] / 1e9
            print(f"| {m} | {name} | {best[name] * 1e3:.2f} | {gbps:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
