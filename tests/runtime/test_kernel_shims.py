"""Our ops' C entry points (runtime/kernels/aoti_shim.h) match what a compiled package calls.

A package compiled with `custom_ops_to_c_shims` calls `aoti_torch_cpu_<op>` with arguments laid
out by the op's schema and the declaration we give AOTInductor (runtime/kernels/__init__.py
c_shim_declaration). C linkage checks no types: a definition whose parameters drift from the
schema would be called with the wrong arguments. So each definition in the sources is checked
here against the declaration made from the loaded op's schema, and each is exported by the
library; and a program compiled with them calls them, not the proxy executor, and computes
what the op computes through the dispatcher.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
import torch

from pipeline.compile.kernels import build_kernels
from runtime import kernels
from runtime.host import host_cpu_target


@pytest.fixture(scope="module", autouse=True)
def library() -> Path:
    path = build_kernels(host_cpu_target())
    kernels.load(path)
    return path


def _definitions() -> dict[str, str]:
    """op -> the parameter list of its AOTI_ENTRY_POINT definition, whitespace normalised."""
    out = {}
    for src in kernels.SOURCES:
        for m in re.finditer(r"AOTI_ENTRY_POINT aoti_torch_cpu_(\w+)\(([^)]*)\)", src.read_text()):
            out[m.group(1)] = " ".join(m.group(2).split())
    return out


def test_every_entry_point_has_its_op_s_schema_and_is_exported() -> None:
    defs = _definitions()
    assert set(defs) == set(kernels.SHIM_OPS)
    for op in kernels.SHIM_OPS:
        want = kernels.c_shim_declaration(op)
        params = want[want.index("(") + 1 : -1]
        assert defs[op] == params, op
    shims = kernels.c_shims()
    assert {o.name() for o in shims} == {f"aotllm::{op}" for op in kernels.SHIM_OPS}


def test_a_program_calls_the_entry_points_and_computes_what_the_ops_compute(
        tmp_path: Path) -> None:
    ops = torch.ops.aotllm

    class Step(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor) -> torch.Tensor:
            h = ops.linear(x, w, b, False)  # a Tensor? given
            y = ops.linear(h, w, None, True)  # and None; a bool true
            q = y.view(-1, 2, 16)
            return ops.paged_decode_attention(q, k, v, tables, lens, 0.25, None, 0)  # float, int

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 32), torch.randn(32, 32), torch.randn(32)
    k, v = torch.randn(4, 4, 2, 16), torch.randn(4, 4, 2, 16)  # [blocks, block, heads, dim]
    tables, lens = torch.tensor([[1, 2], [3, 0], [2, 0]]), torch.tensor([6, 3, 2])
    args = (x, w, b, k, v, tables, lens)
    ep = torch.export.export(Step(), args, strict=False)
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(tmp_path / "step.pt2"),
        inductor_configs={"aot_inductor.custom_ops_to_c_shims": kernels.c_shims()})
    with torch.inference_mode():
        want = Step()(*args)
        got = torch._inductor.aoti_load_package(path)(*args)
    assert torch.equal(got, want)
    with zipfile.ZipFile(path) as z:
        wrapper = next(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_linear(") == 3  # its declaration and two calls
    assert "aoti_torch_cpu_paged_decode_attention(" in wrapper
    assert "proxy_executor_call_function" not in wrapper
