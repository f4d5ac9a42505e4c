"""What the Executor constructor does before it serves: read config.json, check the MPI world
against the engine's parallelism, "deserialize" rank{N}.engine (rejecting another SM, TensorRT
or TensorRT-LLM), check that in-flight batching can run the engine, and size the paged KV
cache (reference §1.3, §1.4, §2.1; executorImpl.cpp, trtGptModelInflightBatching.cpp)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._fake import env
from ..._fake.engine_file import parse_engine_bytes
from ..._fake.toy import ToyModel
from ._config import KvCacheConfig

ERR = "[TensorRT-LLM][ERROR] "
DESERIALIZE_FAILED = (
    ERR + "Assertion failed: Failed to deserialize cuda engine "
    "(/fake/cpp/tensorrt_llm/runtime/tllmRuntime.cpp)"
)
WORLD_SIZE_MISMATCH = (
    ERR + "Assertion failed: With communicationMode kLEADER, MPI worldSize is expected to be "
    "equal to tp*pp*cp when participantIds are not specified"
)
INFLIGHT_NEEDS = (
    ERR + "Assertion failed: TrtGptModelInflightBatching requires GPT attention/Mamba Conv 1d "
    "plugin with packed input and paged KV cache."
)
DEFAULT_FREE_GPU_MEMORY_FRACTION = 0.9


@dataclass
class LoadedEngine:
    config: dict[str, Any]  # the engine's config.json
    toy: ToyModel
    tp_size: int
    pp_size: int
    cp_size: int
    weight_bytes: int  # this rank's share
    kv_bytes_per_token: int  # this rank's share

    @property
    def build(self) -> dict[str, Any]:
        return self.config["build_config"]


def load_engine(model_path: Path, rank: int, world_size: int) -> LoadedEngine:
    cfg_path = model_path / "config.json"
    if not cfg_path.is_file():
        raise RuntimeError(ERR + f"Engine config not found: {cfg_path}")
    cfg = json.loads(cfg_path.read_text())
    if not {"version", "pretrained_config", "build_config"} <= cfg.keys():
        raise RuntimeError(
            ERR + f"Invalid engine config {cfg_path}: expected version, "
            "pretrained_config and build_config (rebuild with trtllm-build)"
        )
    mapping = cfg["pretrained_config"]["mapping"]
    tp, pp, cp = mapping["tp_size"], mapping["pp_size"], mapping.get("cp_size", 1)
    if world_size != tp * pp * cp:
        raise RuntimeError(WORLD_SIZE_MISMATCH)
    plan_path = model_path / f"rank{rank}.engine"
    if not plan_path.is_file():
        raise RuntimeError(ERR + f"Engine file not found: {plan_path}")
    try:
        plan = parse_engine_bytes(plan_path.read_bytes())
    except ValueError:
        env.trt_log_error(1, "Serialization assertion magicTagRead == kMAGIC_TAG failed.")
        raise RuntimeError(DESERIALIZE_FAILED) from None
    _check_compatible(plan)
    _check_inflight_batching(cfg["build_config"])
    pc = cfg["pretrained_config"]
    return LoadedEngine(
        cfg,
        ToyModel.from_dict(plan["toy"]),
        tp,
        pp,
        cp,
        _weight_bytes(pc, tp, pp),
        _kv_bytes_per_token(pc, tp, pp),
    )


def _check_compatible(plan: dict[str, Any]) -> None:
    # Order of a real load: TensorRT reads the plan header (version), then checks the device;
    # only a plan TensorRT accepts can reach TensorRT-LLM's own I/O-tensor checks.
    if plan["tensorrt_version"] != env.tensorrt_version():
        env.trt_log_error(
            6,
            "The engine plan file is not compatible with this version of "
            f"TensorRT, expecting library version {plan['tensorrt_version']} got "
            f"{env.tensorrt_version()}, please rebuild.",
        )
        raise RuntimeError(DESERIALIZE_FAILED)
    if plan["sm"] != env.device_sm():
        env.trt_log_error(
            6,
            "The engine plan file is generated on an incompatible device, "
            f"expecting compute {plan['sm']} got compute {env.device_sm()}, "
            "please rebuild.",
        )
        raise RuntimeError(DESERIALIZE_FAILED)
    if plan["trtllm_version"] != env.trtllm_version():
        # No single documented text: drift shows up as I/O tensor name or shape assertions.
        raise RuntimeError(
            ERR + "Assertion failed: engine I/O tensors do not match this runtime (engine built "
            f"by TensorRT-LLM {plan['trtllm_version']}, runtime is {env.trtllm_version()}); "
            "rebuild the engine"
        )


def _check_inflight_batching(bc: dict[str, Any]) -> None:
    """In-flight batching (the only batching the Executor has) needs the GPT attention plugin,
    packed input (remove_input_padding) and a paged KV cache."""
    plugins = bc.get("plugin_config", {})
    paged = str(bc.get("kv_cache_type") or "").lower() == "paged"
    if not (plugins.get("gpt_attention_plugin") and plugins.get("remove_input_padding") and paged):
        raise RuntimeError(INFLIGHT_NEEDS)


def kv_cache_blocks(eng: LoadedEngine, kv: KvCacheConfig) -> int:
    """Blocks of the paged KV cache: `free_gpu_memory_fraction` (default 0.9) of the memory left
    after weights, capped by `max_tokens`; when both are set the smaller wins."""
    free = env.gpu_memory_bytes() - eng.weight_bytes
    if free <= 0:
        raise RuntimeError(
            ERR + f"out of memory: the weights need {eng.weight_bytes / 2**30:.1f} "
            f"GiB, the GPU has {env.gpu_memory_bytes() / 2**30:.1f} GiB"
        )
    frac = kv.free_gpu_memory_fraction
    frac = DEFAULT_FREE_GPU_MEMORY_FRACTION if frac is None else frac
    tokens = int(free * frac) // eng.kv_bytes_per_token
    if kv.max_tokens is not None:
        tokens = min(tokens, kv.max_tokens)
    return tokens // eng.build["plugin_config"]["tokens_per_block"]


def _dtype_bytes(pc: dict[str, Any]) -> int:
    return 4 if pc["dtype"] == "float32" else 2


def _weight_bytes(pc: dict[str, Any], tp: int, pp: int) -> int:
    h, inter, vocab = pc["hidden_size"], pc["intermediate_size"], pc["vocab_size"]
    head_dim = h // pc["num_attention_heads"]
    attn = h * (pc["num_attention_heads"] + 2 * pc["num_key_value_heads"]) * head_dim + h * h
    per_layer = attn + 3 * h * inter
    total = pc["num_hidden_layers"] * per_layer // pp + 2 * vocab * h
    return total * _dtype_bytes(pc) // tp


def _kv_bytes_per_token(pc: dict[str, Any], tp: int, pp: int) -> int:
    head_dim = pc["hidden_size"] // pc["num_attention_heads"]
    kv_heads = max(1, pc["num_key_value_heads"] // tp)  # replicated when fewer than TP
    layers = max(1, pc["num_hidden_layers"] // pp)
    return 2 * layers * kv_heads * head_dim * _dtype_bytes(pc)
