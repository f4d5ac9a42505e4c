"""`--backend trtllm`: TensorRT-LLM 1.2.x conversion and engine build, and the host probes
(GPU SM, TensorRT-LLM and TensorRT versions) that the build records and serve checks.

Written against shared/reference/tensorrt-llm-1.2-api.md (§1.1-§1.4), the documented Python
path: per rank, `LLaMAForCausalLM.from_hugging_face(hf_dir, dtype, mapping=Mapping(...))`,
`save_checkpoint`, then `tensorrt_llm.builder.build(model, BuildConfig(...))` and
`engine.save(engine_dir)`. The engine directory keeps TensorRT-LLM's own layout: its
`config.json` (the EngineConfig the Executor reads) and `rank{N}.engine`. Our model config,
which other backends keep in config.json, lives in `model_config.json` beside it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from pipeline.config import BuildProfile
from pipeline.errors import EXIT_FAILURE, BuildError
from pipeline.models.config import ModelConfig
from pipeline.progress import Progress
from pipeline.target import Target

TRTLLM_CONFIG = "config.json"  # TensorRT-LLM's EngineConfig (rank 0 writes it)
MODEL_CONFIG = "model_config.json"  # ours: {"model": ModelConfig, "hf_config": ...}
CHECKPOINT_DIR = ".trtllm-checkpoint"  # inside the staging dir; removed before hashing
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM")
# Only consulted when torch cannot query the GPU itself (a CPU-only torch beside TensorRT-LLM,
# or the test suite's contract fake, which has no CUDA): the GPU's SM, e.g. sm_90 or 9.0.
SM_ENV = "AOTLLM_GPU_SM"
INSTALL = (
    "pip install '.[trtllm]' --extra-index-url https://pypi.nvidia.com "
    "(TensorRT-LLM 1.2.x and its TensorRT) on a host with an NVIDIA GPU"
)


def is_trtllm_engine(engine_dir: Path) -> bool:
    """Whether the engine's manifest says backend "trtllm" (False when it cannot be read:
    the torch resolve gate then says why)."""
    try:
        return json.loads((Path(engine_dir) / "manifest.json").read_text())["backend"] == "trtllm"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def import_trtllm() -> ModuleType:
    """`tensorrt_llm`, or ImportError (callers phrase the one-line error for their stage)."""
    return importlib.import_module("tensorrt_llm")


def trtllm_versions() -> dict[str, str]:
    """The versions an engine is tied to (reference §1.4): TensorRT-LLM and TensorRT."""
    try:
        tllm = import_trtllm()
        trt = importlib.import_module("tensorrt")
    except ImportError as e:
        raise BuildError(f"TensorRT-LLM or TensorRT is not installed ({e})", INSTALL) from e
    return {"tensorrt_llm": str(tllm.__version__), "tensorrt": str(trt.__version__)}


def normalize_sm(raw: str) -> str | None:
    """'sm_90', 'sm90', '90' or '9.0' -> 'sm_90'; None when it is not an SM."""
    m = re.fullmatch(r"(?:sm_?)?(\d+)\.?(\d)", raw.strip().lower())
    return f"sm_{int(m.group(1))}{m.group(2)}" if m else None


def gpu_sm() -> str | None:
    """The SM of the GPU this process would use: torch's CUDA first, then AOTLLM_GPU_SM."""
    from pipeline.target import _cuda_sm

    sm = _cuda_sm()
    if sm is not None:
        return sm
    raw = os.environ.get(SM_ENV)
    return normalize_sm(raw) if raw else None


def trtllm_target(requested: str) -> Target:
    """The target of a TensorRT engine: TensorRT builds for the GPU it runs on."""
    if requested == "cpu":
        raise BuildError(
            "TensorRT-LLM engines run on NVIDIA GPUs only, not --target cpu",
            "use --target auto or sm_XX on the GPU host, or --backend aoti for a CPU engine",
        )
    have = gpu_sm()
    if requested.startswith("sm"):
        want = normalize_sm(requested)
        if want is None:
            raise BuildError(f"unknown --target {requested!r}", "give an SM such as sm_90")
        if have is not None and have != want:
            raise BuildError(
                f"--target {want} was requested but this host's GPU is {have}; TensorRT builds "
                "an engine for the GPU it runs on",
                f"build on a host with an {want} GPU, or use --target {have}",
            )
        return Target(device="cuda", sm=want)
    if requested not in ("auto", "cuda"):
        raise BuildError(f"unknown --target {requested!r}", "use auto, cuda or an SM such as sm_90")
    if have is None:
        raise BuildError(
            "cannot tell this host's GPU SM (torch sees no CUDA device)",
            f"pass --target sm_XX (the GPU's compute capability) or set {SM_ENV}",
        )
    return Target(device="cuda", sm=have)


def check_source(hf_config: dict[str, Any]) -> None:
    arch = (hf_config.get("architectures") or [None])[0]
    if arch not in LLAMA_FAMILY:
        raise BuildError(
            f"the trtllm backend converts Llama-family checkpoints only, not {arch!r}",
            f"use a {' or '.join(LLAMA_FAMILY)} checkpoint, or --backend aoti",
        )


def make_build_config(profile: BuildProfile) -> Any:
    """tensorrt_llm.BuildConfig from our profile, spelled as reference §1.2 / §6 spells it."""
    tllm = import_trtllm()
    from tensorrt_llm.plugin.plugin import PluginConfig

    plugins = PluginConfig(
        gemm_plugin="auto",  # the docs' advice for FP16/BF16; default is off
        use_paged_context_fmha=True,  # chunked context and KV reuse need it
        multiple_profiles=True,  # costs build time only
        tokens_per_block=profile.tokens_per_block,
    )
    # opt_num_tokens stays unset: with multiple_profiles it raises RuntimeError.
    return tllm.BuildConfig(
        max_batch_size=profile.max_batch_size,
        max_input_len=profile.max_seq_len - 1,  # serve admits prompts up to max_seq_len - 1
        max_seq_len=profile.max_seq_len,
        max_num_tokens=profile.max_num_tokens,
        kv_cache_type="paged",
        plugin_config=plugins,
    )


def write_model_config(hf_dir: Path, engine_dir: Path) -> ModelConfig:
    hf = json.loads((hf_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(hf)
    text = json.dumps({"model": cfg.to_dict(), "hf_config": hf}, indent=2, sort_keys=True)
    (engine_dir / MODEL_CONFIG).write_text(text)
    return cfg


def load_model_config(engine_dir: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((engine_dir / MODEL_CONFIG).read_text())["model"])


def convert_and_build(
    hf_dir: Path, engine_dir: Path, tp: int, dtype: str, profile: BuildProfile,
    progress: Progress | None = None,
) -> dict[str, float]:
    """Every rank, one at a time: convert, save its checkpoint, build, save its engine.

    Returns seconds per stage ("convert", "compile"). A rank's checkpoint shard is deleted as
    soon as its engine is saved, so the peak extra disk is one rank's weights.
    """
    progress = progress or Progress.silent()
    tllm = import_trtllm()
    from tensorrt_llm.builder import build
    from tensorrt_llm.models import LLaMAForCausalLM

    write_model_config(hf_dir, engine_dir)
    ckpt = engine_dir / CHECKPOINT_DIR
    ckpt.mkdir()
    build_config = make_build_config(profile)
    secs = {"convert": 0.0, "compile": 0.0}
    try:
        with progress.stage("trtllm convert + build", total=tp, unit="ranks") as st:
            for rank in range(tp):
                t0 = time.perf_counter()
                mapping = tllm.Mapping(world_size=tp, rank=rank, tp_size=tp, pp_size=1)
                model = LLaMAForCausalLM.from_hugging_face(str(hf_dir), dtype, mapping=mapping)
                model.save_checkpoint(str(ckpt), save_config=(rank == 0))
                t1 = time.perf_counter()
                engine = build(model, build_config)
                engine.save(str(engine_dir))
                secs["convert"] += t1 - t0
                secs["compile"] += time.perf_counter() - t1
                (ckpt / f"rank{rank}.safetensors").unlink(missing_ok=True)
                del model, engine
                st.advance(1)
    except BuildError:
        raise
    except Exception as e:  # TensorRT-LLM's own errors: one line, with what it said
        raise BuildError(
            f"TensorRT-LLM failed to build the engine: {type(e).__name__}: {e}",
            "check the GPU, the TensorRT-LLM install and the checkpoint; rerun with --debug",
            exit_code=EXIT_FAILURE,
        ) from e
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    missing = [n for n in (TRTLLM_CONFIG, *(f"rank{r}.engine" for r in range(tp)))
               if not (engine_dir / n).is_file()]
    if missing:
        raise BuildError(f"TensorRT-LLM did not write {', '.join(missing)}",
                         "rerun with --debug and report it", exit_code=EXIT_FAILURE)
    return secs


def compute_golden(engine_dir: Path, tp: int, dtype: str) -> dict[str, Any]:
    """Run the built engine through the Executor (under mpirun when tp > 1: LEADER mode wants
    one MPI rank per engine rank) and record the golden prompt's greedy tokens. Token ids
    only: a TensorRT engine returns no logits unless built to gather them."""
    from pipeline.golden import GOLDEN_PROMPT, GOLDEN_STEPS, golden_prompt_ids
    from pipeline.mpi import child_env, mpirun_argv

    prompt = golden_prompt_ids(engine_dir, load_model_config(engine_dir).vocab_size)[:64]
    io = engine_dir / ".golden.json"  # removed before the engine's files are hashed
    io.write_text(json.dumps({"prompt_token_ids": prompt, "steps": GOLDEN_STEPS}))
    cmd = [sys.executable, "-m", "pipeline.compile.trtllm_golden", str(engine_dir), str(io)]
    if tp > 1:
        cmd = [*mpirun_argv(tp), *cmd]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
        tokens = json.loads(io.read_text()).get("tokens")
        if proc.returncode != 0 or tokens is None:
            tail = " ".join((proc.stderr or proc.stdout).strip().split())[-1500:]
            raise BuildError(f"the golden run of the built engine failed: {tail}",
                             "rerun with --debug; check the GPU and the TensorRT-LLM install",
                             exit_code=EXIT_FAILURE)
    finally:
        io.unlink(missing_ok=True)
    return {"kind": "tokens", "prompt": GOLDEN_PROMPT, "prompt_token_ids": prompt,
            "tokens": tokens, "dtype": dtype}
