"""Compile runtime/kernels/*.cpp for the engine's target ISA into one shared library.

The result is cached by a digest of the sources, the flags, torch's version and the
compiler's (`$AOT_LLM_CACHE/kernels/<digest>/`): engines built on the same host share it,
and a second build compiles nothing. The engine carries its own copy (`kernels.so`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch
from torch.utils import cpp_extension

from contract.errors import EXIT_FAILURE, BuildError
from contract.target import Target
from pipeline.progress import Progress
from pipeline.resolve import cache_root
from runtime.kernels import HEADERS, SOURCES

# The ISA levels of contract/target.py as x86-64 micro-architecture levels and the
# extensions above them: our kernels' flags, and Inductor's `cpp.march` for the step
# program (pipeline/compile/aoti.py), whose default, -march=native, would put the build
# host's instructions into an engine recorded for a weaker target.
MARCH = {"baseline": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4",
         "avx512_bf16": "x86-64-v4", "amx": "x86-64-v4"}
_EXTENSIONS = {"avx512_bf16": ["-mavx512bf16", "-mavx512vnni"],
               "amx": ["-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"]}
_ISA_FLAGS = {isa: [f"-march={m}", *_EXTENSIONS.get(isa, [])] for isa, m in MARCH.items()}
LIB_NAME = "libaotllm_kernels.so"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise BuildError("no C++ compiler found (g++ or $CXX)",
                         "install g++ (apt-get install g++), or build with --backend eager")
    return cxx


def compile_flags(target: Target) -> list[str]:
    isa = _ISA_FLAGS.get(target.isa or "baseline", []) if target.arch in ("x86_64", "AMD64") else []
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O3", "-shared", "-fPIC", "-std=c++17", "-fopenmp", *isa,
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in cpp_extension.include_paths())]


def compiler_errors(stderr: str, limit: int = 1500) -> str:
    """The compiler's error lines (gcc: `file:line:col: error: ...`, an internal compiler
    error, a linker's), in order, on one line: torch's headers bring pages of warnings,
    and the tail of the output held those rather than the error that failed the build.
    Without an error line, the output's tail."""
    lines = [ln.strip() for ln in stderr.splitlines()]
    errors = [ln for ln in lines if re.search(r"\b(error|Error)\b", ln)]
    text = " | ".join(errors) if errors else " ".join(stderr.split())[-limit:]
    return text[:limit]


def build_kernels(target: Target, progress: Progress | None = None) -> Path:
    """The kernels library for `target` (compiled, or taken from the cache)."""
    cxx = _compiler()
    flags = compile_flags(target)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256("\0".join([torch.__version__, version, *flags]).encode())
    for src in (*SOURCES, *HEADERS):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    out_dir = cache_root() / "kernels" / h.hexdigest()[:16]
    lib = out_dir / LIB_NAME
    if lib.is_file():
        return lib
    progress = progress or Progress.silent()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{LIB_NAME}.{os.getpid()}"
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    cmd = [cxx, *flags, *map(str, SOURCES), "-o", str(tmp), *libs, "-lc10", "-ltorch_cpu",
           "-ltorch"]
    with progress.stage("compile kernels"):
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"compiling the engine's kernels failed: {compiler_errors(proc.stderr)}",
                         "check the C++ compiler, or build with --backend eager",
                         exit_code=EXIT_FAILURE)
    os.replace(tmp, lib)  # atomic: a concurrent build sees the whole library or none
    return lib
