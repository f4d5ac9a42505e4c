"""The toolchain an engine was built with: recorded in the manifest, part of its id."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import platform
from pathlib import Path

# The packages whose code shapes an engine's bytes: the format, the model and its sharding
# rule, and the build itself.
_SHAPING_PACKAGES = ("contract", "runtime", "pipeline")


@functools.cache
def source_digest() -> str:
    """A digest of the code that shapes the bytes, so an edit to the converter, the model or
    the compiler never returns an engine built by the old code from the cache."""
    repo = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pkg in _SHAPING_PACKAGES:
        for p in sorted(f for ext in ("*.py", "*.cpp", "*.h") for f in (repo / pkg).rglob(ext)):
            h.update(p.relative_to(repo).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _package_version() -> str:
    try:
        return importlib.metadata.version("aot-llm-pipeline")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "0.0.0"


def toolchain_versions(backend: str) -> dict[str, str]:
    import torch
    import transformers

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pipeline": f"{_package_version()}+src.{source_digest()}",
    }
    if backend == "trtllm":  # a TensorRT engine is tied to both (and to the GPU SM)
        from runtime.executors.trtllm_setup import trtllm_versions

        versions.update(trtllm_versions())
    return versions
