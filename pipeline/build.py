"""The build orchestration: resolve -> id -> (cache hit) -> convert -> compile -> golden -> commit.

Everything that can be refused cheaply (target, backend, checkpoint files, --tp) is refused
before the first heavy byte moves; everything heavy happens in a staging directory that
becomes the engine only by an atomic rename at the very end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from contract.errors import BuildError
from contract.layout import GENERATION_CONFIG, TOKENIZER_FILES, weight_layout_for
from contract.manifest import (
    Manifest,
    Source,
    engine_files,
    engine_id,
    engine_inputs,
    hash_engine_files,
    read_manifest,
    write_manifest,
)
from contract.quant import Quantization
from contract.speculative import Speculative
from contract.target import Target
from pipeline.checkpoint import ResolvedSource, checkpoint_digest, checkpoint_files
from pipeline.config import BuildConfig
from pipeline.progress import Progress
from pipeline.resolve import cache_root, resolve
from pipeline.store import EngineStore
from pipeline.target import detect_target, trtllm_target
from pipeline.toolchain import toolchain_versions
from runtime.models.config import ModelConfig
from runtime.models.factory import torch_dtype
from runtime.store.loader import ST_DTYPES

# Copied from the checkpoint beside the shards (config.json is written by the converter).
ENGINE_EXTRA_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG)


@dataclass(frozen=True, slots=True)
class BuildResult:
    engine_dir: Path
    engine_id: str
    model_name: str
    cache_hit: bool  # True: an identical engine existed; nothing was converted or compiled
    stages: dict[str, float]  # the stages that ran, in order -> seconds
    manifest: Manifest


class _Clock:
    """Times the build's stages; the result's `stages` says exactly what ran."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - t0


def _check_backend(cfg: BuildConfig) -> None:
    """TensorRT-LLM is looked for, never imported: its import initialises MPI, and this
    process later starts `mpirun` (the TensorRT-LLM steps run in child processes)."""
    if cfg.backend != "trtllm":
        return
    from runtime.executors.trtllm_setup import trtllm_missing

    if trtllm_missing() is not None:
        raise BuildError(
            "the trtllm backend needs TensorRT-LLM 1.2.x, which is not installed",
            "pip install .[trtllm] on a host with an NVIDIA GPU, or use --backend aoti",
        )


def _read_hf_config(local_dir: Path) -> dict:
    try:
        return json.loads((local_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise BuildError(
            f"cannot read {local_dir / 'config.json'} ({e})", "repair the checkpoint"
        ) from e


def estimate_engine_bytes(local_dir: Path, dtype: str, backend: str = "eager", tp: int = 1) -> int:
    """Bytes the engine will take, erring high: every weight cast to ``dtype`` plus 30% (a tied
    embedding stored twice, KV heads replicated across ranks), the tokenizer, and room for
    each rank's compiled package."""
    itemsize = torch_dtype(dtype).itemsize
    weights = 0
    other = 0
    for p in checkpoint_files(local_dir):
        if p.suffix != ".safetensors":
            other += p.stat().st_size
            continue
        with safe_open(str(p), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_slice(name)
                numel = math.prod(t.get_shape())
                stored = ST_DTYPES[t.get_dtype()].itemsize
                weights += numel * (itemsize if ST_DTYPES[t.get_dtype()].is_floating_point else stored)
    packages = (64 << 20) * tp if backend == "aoti" else 0
    return int(weights * 1.3) + other + packages + (16 << 20)


def _copy_extras(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in ENGINE_EXTRA_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


@dataclass(frozen=True, slots=True)
class BuildPlan:
    """Everything decided before any heavy work: what to build and the id it will have."""

    source: ResolvedSource
    model_config: ModelConfig
    target: Target
    digest: str
    toolchain: dict[str, str]
    engine_id: str
    quant: Quantization
    weight_layout: str = "rows"  # contract/layout.py: chosen for the target (a tactic)
    speculative: Speculative | None = None  # the build's, a draft engine pinned (_pin_draft)


def plan_build(cfg: BuildConfig, progress: Progress | None = None) -> BuildPlan:
    """Check the inputs (target, backend, checkpoint, --tp) and compute the engine id."""
    progress = progress or Progress.silent()
    clock = _Clock()
    return _plan(cfg, progress, clock)


def _plan(cfg: BuildConfig, progress: Progress, clock: _Clock) -> BuildPlan:
    _check_backend(cfg)  # first: a missing TensorRT-LLM is the one thing to say
    target = trtllm_target(cfg.target) if cfg.backend == "trtllm" else detect_target(cfg.target)
    if cfg.backend == "eager" and target.device == "cpu":
        # Eager shards are plain tensors: no ISA is baked in, so record none and let the
        # engine (and its id) be the same whichever x86 host built it.
        target = dataclasses.replace(target, isa="baseline")
    with clock("resolve"), progress.stage("resolve"):
        src = resolve(cfg.model, cache_root(), progress)
        hf_cfg = _read_hf_config(src.local_dir)
        model_cfg = ModelConfig.from_hf_config(hf_cfg)
        model_cfg.check_tp(cfg.tp)
        if cfg.backend == "trtllm":
            from pipeline.compile.trtllm import check_source

            check_source(hf_cfg)
        from pipeline.quant import plan_quant

        quant = plan_quant(cfg, src, model_cfg, target)
        if cfg.speculative is not None and cfg.speculative.method == "draft":
            cfg = _pin_draft(cfg, src.local_dir, model_cfg, target)
    with clock("digest"):
        digest = checkpoint_digest(src.local_dir, progress)
    toolchain = toolchain_versions(cfg.backend)
    # Pair panels for quantized 16-bit models: their kernel takes 16-bit inputs (float32
    # ones would be dequantized per call there; layout 1's rows keep a float32 path).
    layout = weight_layout_for(cfg.backend, target.device, target.isa,
                               quant.enabled and cfg.dtype in ("bfloat16", "float16"), cfg.dtype)
    inputs = engine_inputs(
        source_digest=digest,
        backend=cfg.backend,
        target=target,
        tp=cfg.tp,
        dtype=cfg.dtype,
        profile=cfg.profile,
        toolchain=toolchain,
        quant=quant,
        weight_layout=layout,
        speculative=cfg.speculative,
    )
    return BuildPlan(src, model_cfg, target, digest, toolchain, engine_id(inputs), quant, layout,
                     cfg.speculative)


def _pin_draft(cfg: BuildConfig, src_dir: Path, model_cfg: ModelConfig,
               target: Target) -> BuildConfig:
    """--speculative draft:ENGINE[:K]: the draft engine must run beside this one (TP=1, this
    host, the checkpoint's vocabulary and tokenizer); it is recorded by absolute path and
    engine id, which enter this engine's id."""
    from runtime.executors.draft import DraftEngineError, pin_draft, vocab_hashes_of

    assert cfg.speculative is not None
    try:
        spec = pin_draft(cfg.speculative, target.device, model_cfg.vocab_size,
                         vocab_hashes_of(src_dir))
    except DraftEngineError as e:
        raise BuildError(f"--speculative: {e.cause}", e.remedy) from None
    return dataclasses.replace(cfg, speculative=spec)


def build_engine(cfg: BuildConfig, progress: Progress | None = None) -> BuildResult:
    """Build (or find in the store) the engine ``cfg`` describes."""
    progress = progress or Progress.silent()
    clock = _Clock()
    plan = _plan(cfg, progress, clock)
    src, eid, target = plan.source, plan.engine_id, plan.target
    store = EngineStore(cfg.store)
    # Every build, a cache hit too, removes what builds that died left in this model directory.
    store.clean_stale(src.name)
    existing = store.find(src.name, eid)
    if existing is not None:
        manifest = read_manifest(existing)
        progress.message(f"cache hit: engine {eid} already built at {existing}")
        return BuildResult(existing, eid, src.name, True, clock.stages, manifest)

    need = estimate_engine_bytes(src.local_dir, cfg.dtype, cfg.backend, cfg.tp)
    with store.staging(src.name, eid, need_bytes=need) as tmp:
        if cfg.backend == "trtllm":  # convert + compile by TensorRT-LLM, per rank
            from pipeline.compile import trtllm

            for name, secs in trtllm.convert_and_build(
                src.local_dir, tmp, cfg.tp, cfg.dtype, cfg.profile, progress, plan.quant
            ).items():
                clock.stages[name] = secs
        else:
            with clock("convert"):
                from pipeline.convert import convert_checkpoint

                get_quantized = None
                if plan.quant.source.startswith("GGUF") and src.gguf_file is not None:
                    from pipeline.gguf import gguf_quant_getter

                    get_quantized = gguf_quant_getter(src.gguf_file, plan.model_config)
                convert_checkpoint(src.local_dir, tmp, cfg.tp, cfg.dtype, progress, plan.quant,
                                   get_quantized, plan.weight_layout)
        if cfg.backend == "aoti":
            with clock("compile"):
                from pipeline.compile.aoti import compile_engine

                compile_engine(
                    engine_dir=tmp,
                    cfg=plan.model_config,
                    tp=cfg.tp,
                    dtype=cfg.dtype,
                    profile=cfg.profile,
                    target=target,
                    progress=progress,
                    quant=plan.quant,
                    weight_layout=plan.weight_layout,
                )
        with clock("copy"), progress.stage("copy tokenizer"):
            _copy_extras(src.local_dir, tmp)
        with clock("golden"), progress.stage("golden"):
            if cfg.backend == "trtllm":
                golden = trtllm.compute_golden(tmp, cfg.tp, cfg.dtype)
            else:
                from pipeline.golden import compute_golden

                golden = compute_golden(tmp, cfg.backend, cfg.tp, cfg.dtype, cfg.profile,
                                        target.device)
        fidelity: dict = {}
        if cfg.backend != "trtllm":
            with clock("fidelity"), progress.stage("fidelity"):
                from pipeline.fidelity import measure_fidelity

                fidelity = measure_fidelity(tmp, src.local_dir, cfg.dtype, plan.quant.enabled)
        with clock("hash"):
            total = sum(p.stat().st_size for p in engine_files(tmp))
            with progress.stage("hash", total=total, unit="B") as st:
                files = hash_engine_files(tmp, st.advance)
        manifest = Manifest(
            engine_id=eid,
            model_name=src.name,
            source=Source(uri=src.uri, revision=src.revision, digest=plan.digest,
                          format=src.format),
            backend=cfg.backend,
            target=target,
            tp=cfg.tp,
            dtype=cfg.dtype,
            profile=cfg.profile,
            toolchain=plan.toolchain,
            files=files,
            golden=golden,
            quant=plan.quant,
            weight_layout=plan.weight_layout,
            fidelity=fidelity,
            speculative=plan.speculative,
        )
        with clock("commit"):
            write_manifest(tmp, manifest)
            final = store.commit(tmp, src.name, eid)
            # A concurrent build of the same id may have committed first: its engine is the
            # one in the store, so report its manifest rather than our discarded copy.
            manifest = read_manifest(final)
    return BuildResult(final, eid, src.name, False, clock.stages, manifest)
