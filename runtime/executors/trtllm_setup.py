"""TensorRT-LLM's presence, versions and the Executor's construction (every rank).

Written against shared/reference/tensorrt-llm-1.2-api.md §1.4 and §2.1. Nothing here imports
`tensorrt_llm` at module import: under MPI that import is a collective (see import_trtllm).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from contract.errors import BuildError
from contract.layout import MODEL_CONFIG_TRTLLM
from runtime.models.config import ModelConfig
from runtime.store.checkpoint import load_engine_model_config

INSTALL = (
    "pip install '.[trtllm]' --extra-index-url https://pypi.nvidia.com "
    "(TensorRT-LLM 1.2.x and its TensorRT) on a host with an NVIDIA GPU"
)


def import_trtllm() -> ModuleType:
    """`tensorrt_llm`, or ImportError (callers phrase the one-line error for their stage).

    Under MPI the import is a collective (`tensorrt_llm/_utils.py` splits COMM_WORLD at import
    time): every rank must import it, or the others block in their import. A job checks
    `trtllm_missing()` on every rank and agrees before any rank imports it."""
    return importlib.import_module("tensorrt_llm")


def trtllm_missing() -> str | None:
    """Why `tensorrt_llm` (or `tensorrt`) cannot be imported here, without importing it (no
    MPI collective); None when both are installed."""
    absent = [m for m in ("tensorrt_llm", "tensorrt") if importlib.util.find_spec(m) is None]
    return f"No module named {absent[0]!r}" if absent else None


def trtllm_mpi_world() -> tuple[int, int]:
    """(rank, world size) as TensorRT-LLM's MPI library sees this process."""
    from tensorrt_llm._utils import mpi_rank, mpi_world_size

    return int(mpi_rank()), int(mpi_world_size())


def trtllm_versions() -> dict[str, str]:
    """The versions an engine is tied to (reference §1.4): TensorRT-LLM and TensorRT, read
    from the installed distributions' metadata, never by importing them (the build process
    must not: importing tensorrt_llm initialises MPI). The TensorRT module ships in a
    distribution of its own name in some releases (e.g. tensorrt-cu12-bindings beside the
    `tensorrt` meta-package), so it is found by the module it provides."""
    versions = {}
    for module in ("tensorrt_llm", "tensorrt"):
        version = installed_version(module)
        if version is None:
            raise BuildError(f"TensorRT-LLM or TensorRT is not installed (no distribution "
                             f"provides the {module!r} module)", INSTALL)
        versions[module] = version
    return versions


def installed_version(module: str) -> str | None:
    """The version of the installed distribution that provides top-level `module`, from its
    metadata (nothing is imported); None when the module or its metadata is absent."""
    if importlib.util.find_spec(module) is None:  # a top-level name: nothing is run
        return None
    # The distribution whose files hold the module first, then one named as it is.
    names = [*importlib.metadata.packages_distributions().get(module, []), module]
    for name in dict.fromkeys(names):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def load_model_config(engine_dir: Path) -> ModelConfig:
    """Our model config of a TensorRT-LLM engine (its config.json is TensorRT-LLM's)."""
    return load_engine_model_config(engine_dir, MODEL_CONFIG_TRTLLM)


def bindings() -> ModuleType:
    """`tensorrt_llm.bindings.executor` (imported on first use: see import_trtllm)."""
    return importlib.import_module("tensorrt_llm.bindings.executor")


def kv_cache_config(fraction: float | None, tokens: int | None) -> Any:
    """--kv-cache-fraction -> free_gpu_memory_fraction, --kv-cache-tokens -> max_tokens;
    neither: TensorRT-LLM's default (90% of the memory free after the engine)."""
    tx = bindings()
    return tx.KvCacheConfig(
        free_gpu_memory_fraction=None if fraction is None else float(fraction),
        max_tokens=None if tokens is None else int(tokens),
    )


def guided_decoding_config(engine_dir: Path) -> tuple[Any, str | None]:
    """(GuidedDecodingConfig, None), or (None, why not) when the engine's tokenizer cannot
    give xgrammar its vocabulary.

    As TensorRT-LLM's own LLM API builds it (`_xgrammar_tokenizer_info` in
    tensorrt_llm/llmapi/tokenizer.py, for a fast tokenizer): the vocabulary's tokens sorted
    by id (`encoded_vocab`), the serialized tokenizer (`tokenizer_str`, from which xgrammar
    detects the vocabulary type), and the stop ids. TensorRT-LLM passes [eos_token_id]; we
    pass every id that ends a sequence here (generation_config's eos ids, the tokenizer's,
    the model config's), so that whichever ends the output, the grammar allows it once the
    output is complete. Deterministic from the engine directory: every rank builds the same."""
    import json

    from runtime.tokenizer import FastTokenizer

    tx = bindings()
    try:
        tok = FastTokenizer(engine_dir)
        vocab = tok.get_vocab()
        tokenizer_str = tok._tok.to_str()
    except Exception as e:  # no tokenizer.json: no vocabulary for xgrammar
        return None, f"the engine's tokenizer gives no vocabulary ({type(e).__name__}: {e})"
    stops: list[int] = []
    try:
        gen = json.loads((engine_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        gen = None
    stops += gen if isinstance(gen, list) else [] if gen is None else [gen]
    eos = tok.eos_token_id
    stops += list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    stops += list(load_model_config(engine_dir).eos_token_ids)
    stops = [int(t) for t in dict.fromkeys(stops)]
    if not stops:
        return None, "the engine declares no eos token, so no grammar could ever end"
    encoded = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    backend = tx.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR
    return tx.GuidedDecodingConfig(backend, encoded_vocab=encoded, tokenizer_str=tokenizer_str,
                                   stop_token_ids=stops), None


def executor_config(kv: Any, guided: Any = None) -> Any:
    tx = bindings()
    return tx.ExecutorConfig(
        max_beam_width=1,
        scheduler_config=tx.SchedulerConfig(
            capacity_scheduler_policy=tx.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
        ),
        kv_cache_config=kv,
        # The engine is built with paged context FMHA, so long prompts are chunked.
        enable_chunked_context=True,
        batching_type=tx.BatchingType.INFLIGHT,
        parallel_config=tx.ParallelConfig(
            communication_type=tx.CommunicationType.MPI,
            communication_mode=tx.CommunicationMode.LEADER,
        ),
        guided_decoding_config=guided,
    )


def construct_executor(engine_dir: Path, kv: Any, guided: Any = None) -> Any:
    """Every rank: deserialize rank{N}.engine, allocate the KV cache, start the executor
    thread (blocks until done). Raises whatever TensorRT-LLM raises. `guided`: a
    GuidedDecodingConfig (`guided_decoding_config`), or None for no structured output."""
    tx = bindings()
    return tx.Executor(str(engine_dir), tx.ModelType.DECODER_ONLY, executor_config(kv, guided))
