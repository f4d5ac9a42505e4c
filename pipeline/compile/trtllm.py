"""`--backend trtllm`: TensorRT-LLM 1.2.x conversion and engine build.

Written against shared/reference/tensorrt-llm-1.2-api.md (§1.1-§1.4), the documented Python
path: per rank, `LLaMAForCausalLM.from_hugging_face(hf_dir, dtype, mapping=Mapping(...))`,
then `tensorrt_llm.builder.build(model, BuildConfig(...))` and `engine.save(engine_dir)`
(the converted model is built in memory; no checkpoint is written). The engine directory
keeps TensorRT-LLM's own layout: its `config.json` (the EngineConfig the Executor reads) and
`rank{N}.engine`. Our model config, which other backends keep in config.json, lives in
`model_config.json` beside it.

The conversion and build run in a child interpreter (pipeline/compile/trtllm_build.py) and the
golden run in another (under mpirun at TP > 1): the build process never imports TensorRT-LLM,
whose import initialises MPI (an MPI process must not start mpirun).

TensorRT's timing cache lives in the staging directory (`input_timing_cache` =
`output_timing_cache`): rank 0 times the kernels, the other ranks reuse its timings, and
nothing is written to the working directory (BuildConfig's default is `model.cache` there).
It is removed before the engine's files are hashed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract.errors import EXIT_FAILURE, BuildError
from contract.layout import MODEL_CONFIG_TRTLLM, TRTLLM_CONFIG, rank_trt_engine
from contract.profile import BuildProfile
from contract.quant import NONE, Quantization
from pipeline.progress import Progress
from runtime.env import GOLDEN_TIMEOUT
from runtime.executors.trtllm_setup import INSTALL, import_trtllm, load_model_config
from runtime.models.config import ModelConfig
from runtime.store.checkpoint import read_model_config, write_engine_model_config

TIMING_CACHE = ".trtllm-timing.cache"  # inside the staging dir; removed before hashing
BUILD_REQUEST = ".trtllm-build.json"  # the build child's input; removed likewise
# The golden run: a few greedy tokens after constructing the Executor (engine deserialization
# and KV-cache allocation are most of it). A hang there (a rank that never joins, an MPI
# launch that never starts) must not hang the build.
GOLDEN_TIMEOUT_ENV = GOLDEN_TIMEOUT.name
GOLDEN_TIMEOUT_S = 900.0
GOLDEN_KILL_GRACE_S = 10.0  # after SIGTERM (mpirun forwards it to its ranks), then SIGKILL
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM")


def check_source(hf_config: dict[str, Any]) -> None:
    arch = (hf_config.get("architectures") or [None])[0]
    if arch not in LLAMA_FAMILY:
        raise BuildError(
            f"the trtllm backend converts Llama-family checkpoints only, not {arch!r}",
            f"use a {' or '.join(LLAMA_FAMILY)} checkpoint, or --backend aoti",
        )


def quant_config(quant: Quantization) -> Any:
    """The QuantConfig from_hugging_face takes for our scheme (None when unquantized).

    `--quant` -> the checkpoint's quantization.quant_algo, as convert_checkpoint.py's
    `--use_weight_only --weight_only_precision int8|int4` and `--use_fp8` set it (§1.1);
    from_hugging_face quantizes these while it loads (no calibration data)."""
    if not quant.enabled:
        return None
    import_trtllm()
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo

    algo = {"int8_wo": QuantAlgo.W8A16, "int4_wo": QuantAlgo.W4A16, "fp8": QuantAlgo.FP8}
    return QuantConfig(quant_algo=algo[quant.scheme])


def make_build_config(profile: BuildProfile, timing_cache: Path | None = None,
                      quant: Quantization = NONE) -> Any:
    """tensorrt_llm.BuildConfig from our profile, spelled as reference §1.2 / §6 spells it.

    `kv_cache_type` is left at its default (PAGED): the string "paged" is converted only by
    the pydantic BuildConfig of 1.2; where BuildConfig is a dataclass it silently disables the
    paged cache, which the Executor then refuses to serve."""
    tllm = import_trtllm()
    from tensorrt_llm.plugin.plugin import PluginConfig

    wanted: dict[str, Any] = {
        # the docs' advice: auto for FP16/BF16 (default is off), off for FP8 (§1.2)
        "gemm_plugin": None if quant.scheme == "fp8" else "auto",
        "use_paged_context_fmha": True,  # chunked context and KV reuse need it
        "multiple_profiles": True,  # costs build time only
        "tokens_per_block": profile.tokens_per_block,
    }
    try:
        plugins = PluginConfig(
            gemm_plugin=wanted["gemm_plugin"],
            use_paged_context_fmha=wanted["use_paged_context_fmha"],
            multiple_profiles=wanted["multiple_profiles"],
            tokens_per_block=wanted["tokens_per_block"],
        )
    except TypeError as e:  # releases whose PluginConfig is a dataclass of init=False fields
        raise BuildError(f"this TensorRT-LLM's PluginConfig does not take {sorted(wanted)} "
                         f"({e})", "install TensorRT-LLM 1.2.x") from None
    # PluginConfig ignores keys it does not know: read back what we set. A field set to
    # "auto" reads back as the config's dtype (plugin.py: `if name != "dtype" and value ==
    # "auto": return self.dtype`), so "auto" is taken as set when it reads either way.
    resolved = getattr(plugins, "dtype", None)
    lost = sorted(k for k, v in wanted.items()
                  if getattr(plugins, k, None) not in ((v, resolved) if v == "auto" else (v,)))
    if lost:
        raise BuildError(f"this TensorRT-LLM's PluginConfig did not take {lost}",
                         "check the installed TensorRT-LLM is 1.2.x")
    cache = None if timing_cache is None else str(timing_cache)
    # opt_num_tokens stays unset: with multiple_profiles it raises RuntimeError.
    return tllm.BuildConfig(
        max_batch_size=profile.max_batch_size,
        max_input_len=profile.max_seq_len - 1,  # serve admits prompts up to max_seq_len - 1
        max_seq_len=profile.max_seq_len,
        max_num_tokens=profile.max_num_tokens,
        plugin_config=plugins,
        input_timing_cache=cache,
        output_timing_cache=cache,
    )


def write_model_config(hf_dir: Path, engine_dir: Path) -> ModelConfig:
    cfg, hf = read_model_config(hf_dir)
    write_engine_model_config(engine_dir, cfg, hf, MODEL_CONFIG_TRTLLM)
    return cfg


def convert_and_build(
    hf_dir: Path, engine_dir: Path, tp: int, dtype: str, profile: BuildProfile,
    progress: Progress | None = None, quant: Quantization = NONE,
) -> dict[str, float]:
    """Convert and build every rank in a child interpreter (pipeline.compile.trtllm_build),
    relaying its progress: this process never imports TensorRT-LLM (whose import initialises
    MPI, making this process an MPI singleton before it starts `mpirun` for the golden run).

    Returns seconds per stage ("convert", "compile"). A failure is one BuildError line: the
    child's own cause and remedy, or, when it died, its exit status and the last line it
    printed; the child's whole output is kept in a log file the remedy names.
    """
    progress = progress or Progress.silent()
    request = engine_dir / BUILD_REQUEST
    request.write_text(json.dumps({
        "hf_dir": str(hf_dir), "engine_dir": str(engine_dir), "tp": tp, "dtype": dtype,
        "profile": profile.to_dict(), "quant": quant.to_dict(),
    }))
    fd, log_name = tempfile.mkstemp(prefix="aotllm-trtllm-build-", suffix=".log")
    log = Path(log_name)
    cmd = [sys.executable, "-m", "pipeline.compile.trtllm_build", str(request)]
    keep_log = False  # only when a failure names it
    try:
        with os.fdopen(fd, "wb") as log_file:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file,
                                    stdin=subprocess.DEVNULL, text=True, env=build_child_env())
        outcome: dict[str, Any] = {}
        try:
            assert proc.stdout is not None
            with progress.stage("trtllm convert + build", total=tp, unit="ranks") as st:
                for line in proc.stdout:
                    event = _event(line)
                    if "advance" in event:
                        st.advance(int(event["advance"]))
                    elif "stages" in event or "error" in event:
                        outcome = event
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted here (Ctrl-C, SIGTERM): end the child too
                proc.kill()
                proc.wait()
        kept = f"TensorRT-LLM's full output is in {log}"
        keep_log = "stages" not in outcome or rc != 0
        if "error" in outcome:
            raise BuildError(str(outcome["error"]),
                             f"{outcome.get('remedy') or 'rerun the build'}; {kept}",
                             exit_code=int(outcome.get("exit_code", EXIT_FAILURE)))
        if rc != 0 or "stages" not in outcome:
            raise BuildError(
                f"the TensorRT-LLM build process (`{' '.join(cmd)}`) {_died(rc)}: "
                f"{_last_line(log) or 'it printed nothing'}",
                f"check the GPU, the TensorRT-LLM install and the checkpoint; {kept}",
                exit_code=EXIT_FAILURE)
    finally:
        request.unlink(missing_ok=True)
        (engine_dir / TIMING_CACHE).unlink(missing_ok=True)
        if not keep_log:
            log.unlink(missing_ok=True)
    missing = [n for n in (TRTLLM_CONFIG, *(rank_trt_engine(r) for r in range(tp)))
               if not (engine_dir / n).is_file()]
    if missing:
        raise BuildError(f"TensorRT-LLM did not write {', '.join(missing)}",
                         "rerun the build and report it", exit_code=EXIT_FAILURE)
    return {k: float(v) for k, v in outcome["stages"].items()}


def build_child_env() -> dict[str, str]:
    """The build child's environment: this one, with the repository importable."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _event(line: str) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


def _died(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    if rc == 0:
        return "exited without a result"
    return f"exited with status {rc}"


def _last_line(log: Path, limit: int = 400) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    last = next((ln for ln in reversed(lines) if ln), "")
    return last if len(last) <= limit else last[: limit - 3] + "..."


def convert_and_build_here(
    hf_dir: Path, engine_dir: Path, tp: int, dtype: str, profile: BuildProfile,
    quant: Quantization = NONE, advance: Callable[[int], None] = lambda n: None,
) -> dict[str, float]:
    """In the build child (this imports TensorRT-LLM): every rank, one at a time, converted in
    memory (quantized per `quant`), built, its engine saved. Calls `advance(1)` per rank.

    Returns seconds per stage ("convert", "compile"). Peak extra memory is one rank's model.
    """
    timing_cache = engine_dir / TIMING_CACHE
    secs = {"convert": 0.0, "compile": 0.0}
    try:
        try:
            tllm = import_trtllm()
        except ImportError as e:
            raise BuildError(f"the TensorRT-LLM build process cannot import TensorRT-LLM ({e})",
                             f"repair the install: {INSTALL}", exit_code=EXIT_FAILURE) from e
        from tensorrt_llm.builder import build
        from tensorrt_llm.models import LLaMAForCausalLM

        write_model_config(hf_dir, engine_dir)
        build_config = make_build_config(profile, timing_cache, quant)
        qc = quant_config(quant)
        for rank in range(tp):
            t0 = time.perf_counter()
            mapping = tllm.Mapping(world_size=tp, rank=rank, tp_size=tp, pp_size=1)
            model = LLaMAForCausalLM.from_hugging_face(str(hf_dir), dtype, mapping=mapping,
                                                       quant_config=qc)
            t1 = time.perf_counter()
            engine = build(model, build_config)
            engine.save(str(engine_dir))
            secs["convert"] += t1 - t0
            secs["compile"] += time.perf_counter() - t1
            del model, engine
            advance(1)
    except BuildError:
        raise
    except Exception as e:  # TensorRT-LLM's own errors: one line, with what it said
        raise BuildError(
            f"TensorRT-LLM failed to build the engine: {type(e).__name__}: {e}",
            "check the GPU, the TensorRT-LLM install and the checkpoint",
            exit_code=EXIT_FAILURE,
        ) from e
    finally:
        timing_cache.unlink(missing_ok=True)
    return secs


def compute_golden(engine_dir: Path, tp: int, dtype: str) -> dict[str, Any]:
    """Run the built engine through the Executor (under mpirun when tp > 1: LEADER mode wants
    one MPI rank per engine rank) and record the golden prompt's greedy tokens. Token ids
    only: a TensorRT engine returns no logits unless built to gather them."""
    from runtime.dist.mpi import child_env, mpi_session, mpirun_argv
    from runtime.executors.golden import GOLDEN_PROMPT, GOLDEN_STEPS, golden_prompt_ids

    prompt = golden_prompt_ids(engine_dir, load_model_config(engine_dir).vocab_size)[:64]
    io = engine_dir / ".golden.json"  # removed before the engine's files are hashed
    io.write_text(json.dumps({"prompt_token_ids": prompt, "steps": GOLDEN_STEPS}))
    cmd = [sys.executable, "-m", "pipeline.compile.trtllm_golden", str(engine_dir), str(io)]
    if tp > 1:
        cmd = [*mpirun_argv(tp), *cmd]
    timeout = golden_timeout_s()
    try:
        with mpi_session(child_env()) as env:
            out, err, rc = _run_bounded(cmd, env, timeout)
        tokens = json.loads(io.read_text()).get("tokens") if rc is not None else None
        if rc is None:
            raise BuildError(f"the golden run of the built engine (stage golden, `{' '.join(cmd)}`)"
                             f" did not finish within {timeout:.0f} s and was killed",
                             f"rerun with --debug; check the GPU, the MPI launcher and the "
                             f"TensorRT-LLM install (the limit is {GOLDEN_TIMEOUT_ENV})",
                             exit_code=EXIT_FAILURE)
        if rc != 0 or tokens is None:
            tail = " ".join((err or out).strip().split())[-1500:]
            raise BuildError(f"the golden run of the built engine failed: {tail}",
                             "rerun with --debug; check the GPU and the TensorRT-LLM install",
                             exit_code=EXIT_FAILURE)
    finally:
        io.unlink(missing_ok=True)
    return {"kind": "tokens", "prompt": GOLDEN_PROMPT, "prompt_token_ids": prompt,
            "tokens": tokens, "dtype": dtype}


def golden_timeout_s() -> float:
    """Seconds the golden run may take: AOTLLM_GOLDEN_TIMEOUT_S, else GOLDEN_TIMEOUT_S."""
    raw = GOLDEN_TIMEOUT.raw()
    try:
        value = float(raw) if raw else GOLDEN_TIMEOUT_S
    except ValueError:
        raise BuildError(f"{GOLDEN_TIMEOUT_ENV}={raw!r} is not a number of seconds",
                         f"set {GOLDEN_TIMEOUT_ENV} to e.g. 900") from None
    return value


def _run_bounded(cmd: list[str], env: dict[str, str],
                 timeout_s: float) -> tuple[str, str, int | None]:
    """(stdout, stderr, exit code), or exit code None when it ran past `timeout_s`. The child
    leads a process group of its own, so mpirun and every rank it started are ended with it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return out, err, proc.returncode
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, GOLDEN_KILL_GRACE_S), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, err = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        return "", "", None
