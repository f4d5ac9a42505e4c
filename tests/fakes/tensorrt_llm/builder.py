"""tensorrt_llm.builder: BuildConfig, build(), Engine and its directory layout (§1.2, §1.3).

Engine directory: config.json (rank 0 only: version, pretrained_config, build_config) and one
rank{N}.engine per rank. The fake's plan records the builder's SM, TensorRT and TensorRT-LLM
versions and the toy model; bindings.executor refuses to load it on a different "machine".

Timing cache: build() writes TensorRT's timing cache to `output_timing_cache` (default
"model.cache", relative to the working directory, as the real builder does) and reads
`input_timing_cache` when that file exists; a build without one re-times every kernel.

kv_cache_type: the fake takes a KVCacheType (or None: PAGED) and refuses a plain string,
which only the pydantic BuildConfig of 1.2 converts (case-insensitively); in the dataclass
BuildConfig of earlier 1.x releases the string is not the enum and silently disables the
paged KV cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ._fake import env
from ._fake.engine_file import engine_bytes
from .llmapi.kv_cache_type import KVCacheType
from .models.modeling_utils import PretrainedConfig, PretrainedModel
from .plugin.plugin import PluginConfig

__all__ = ["BuildConfig", "Engine", "EngineConfig", "build", "get_engine_version"]

KV_CACHE_TYPE_STRING = (
    "kv_cache_type={!r}: pass tensorrt_llm.llmapi.kv_cache_type.KVCacheType (or leave it None: "
    "PAGED is the default). A plain string works only where BuildConfig is the pydantic model "
    "with the case-insensitive KVCacheType enum; in the dataclass BuildConfig it is not equal "
    "to KVCacheType.PAGED and silently disables the paged KV cache, so the fake refuses it"
)
INVALID_ENGINE_CONFIG = (
    "Invalid engine config found from {}, please use the corresponding version of trtllm-build "
    "to build the engine."
)


class BuildConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_input_len: int = 1024
    max_seq_len: int | None = None  # None: max_position_embeddings (x rotary factor) or 2048
    max_batch_size: int = 2048
    max_beam_width: int = 1
    max_num_tokens: int = 8192
    opt_num_tokens: int | None = None  # None: max_batch_size * max_beam_width
    kv_cache_type: KVCacheType | None = None  # None: PAGED
    gather_context_logits: bool = False
    strongly_typed: bool = True
    plugin_config: PluginConfig = Field(default_factory=PluginConfig)
    lora_config: dict[str, Any] | None = None
    input_timing_cache: str | None = None
    output_timing_cache: str = "model.cache"
    weight_streaming: bool = False
    use_strip_plan: bool = False
    use_refit: bool = False

    @field_validator("kv_cache_type", mode="before")
    @classmethod
    def _kv_type(cls, v: object) -> object:
        if isinstance(v, str) and not isinstance(v, KVCacheType):
            raise ValueError(KV_CACHE_TYPE_STRING.format(v))
        return v

    @field_validator("max_input_len", "max_batch_size", "max_beam_width", "max_num_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be >= 1")
        return v


class EngineConfig:
    pretrained_config: PretrainedConfig
    build_config: BuildConfig
    version: str

    def __init__(
        self, pretrained_config: PretrainedConfig, build_config: BuildConfig, version: str
    ) -> None:
        self.pretrained_config = pretrained_config
        self.build_config = build_config
        self.version = version

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "pretrained_config": self.pretrained_config.to_dict(),
            "build_config": self.build_config.model_dump(),
        }


class Engine:
    config: EngineConfig
    engine: bytes  # the serialized plan

    def __init__(self, config: EngineConfig, engine: bytes) -> None:
        self.config = config
        self.engine = engine

    def save(self, engine_dir: str | Path, /) -> None:
        out = Path(engine_dir)
        out.mkdir(parents=True, exist_ok=True)
        rank = self.config.pretrained_config.mapping.rank
        if rank == 0:
            (out / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        (out / f"rank{rank}.engine").write_bytes(self.engine)

    @classmethod
    def from_dir(cls, engine_dir: str | Path, rank: int, /) -> Engine:
        d = read_engine_config(engine_dir)
        bc = dict(d["build_config"])
        if bc.get("kv_cache_type") is not None:  # config.json holds the enum's value
            bc["kv_cache_type"] = KVCacheType(bc["kv_cache_type"])
        config = EngineConfig(
            PretrainedConfig.from_dict(d["pretrained_config"], rank),
            BuildConfig.model_validate(bc),
            d["version"],
        )
        return cls(config, (Path(engine_dir) / f"rank{rank}.engine").read_bytes())


def read_engine_config(engine_dir: str | Path) -> dict[str, Any]:
    d = json.loads((Path(engine_dir) / "config.json").read_text())
    if not {"version", "pretrained_config", "build_config"} <= d.keys():
        raise ValueError(INVALID_ENGINE_CONFIG.format(engine_dir))
    return d


def get_engine_version(engine_dir: str | Path, /) -> str | None:
    return json.loads((Path(engine_dir) / "config.json").read_text()).get("version")


def build(model: PretrainedModel, build_config: BuildConfig) -> Engine:
    if not isinstance(model, PretrainedModel):
        raise TypeError(f"model must be a tensorrt_llm model, got {type(model).__name__}")
    if not isinstance(build_config, BuildConfig):
        raise TypeError(f"build_config must be a BuildConfig, got {type(build_config).__name__}")
    bc = build_config.model_copy(deep=True)
    pc = model.config
    _init_max_seq_len(bc, pc)
    if bc.plugin_config.multiple_profiles and bc.opt_num_tokens is not None:
        raise RuntimeError("opt_num_tokens cannot be set together with multiple_profiles")
    if bc.opt_num_tokens is None:
        bc.opt_num_tokens = bc.max_batch_size * bc.max_beam_width
    if bc.kv_cache_type is None:
        bc.kv_cache_type = KVCacheType.PAGED
    _check_quantization(pc.quantization)
    timed = _timing_cache(bc)
    m = pc.mapping
    plan = engine_bytes(
        {
            "trtllm_version": env.trtllm_version(),
            "tensorrt_version": env.tensorrt_version(),
            "sm": env.device_sm(),
            "rank": m.rank,
            "tp_size": m.tp_size,
            "pp_size": m.pp_size,
            "cp_size": m.cp_size,
            "toy": model._toy.to_dict(),
            "kernels_timed": timed,
        }
    )
    return Engine(EngineConfig(_copy_config(pc), bc, env.trtllm_version()), plan)


def _check_quantization(q: dict[str, Any]) -> None:
    """FP8 GEMMs need FP8 tensor cores (sm_89 and newer): TensorRT finds no kernel else."""
    from .quantization import FP8_MIN_SM

    sm = int(env.device_sm().replace(".", ""))
    if str(q.get("quant_algo")) == "FP8" and sm < FP8_MIN_SM:
        raise RuntimeError(f"FP8 quantization needs SM >= {FP8_MIN_SM}, this GPU is SM {sm}")


def _timing_cache(bc: BuildConfig) -> bool:
    """Read input_timing_cache if it exists, write output_timing_cache (relative paths are
    the working directory's). Returns True when kernels had to be timed (no cache read)."""
    cache: dict[str, Any] = {"tensorrt_version": env.tensorrt_version(), "sm": env.device_sm()}
    timed = True
    if bc.input_timing_cache and Path(bc.input_timing_cache).is_file():
        old = json.loads(Path(bc.input_timing_cache).read_text())
        if {k: old.get(k) for k in cache} == cache:
            timed = False
            env.log("INFO", f"Loaded timing cache from {bc.input_timing_cache}")
    if timed:
        env.log("INFO", "No usable timing cache: timing every kernel")
    if bc.output_timing_cache:
        Path(bc.output_timing_cache).write_text(json.dumps(cache))
    return timed


def _init_max_seq_len(bc: BuildConfig, pc: PretrainedConfig) -> None:
    if bc.max_seq_len is None:
        mpe = pc.max_position_embeddings
        scaling = pc.extras.get("rotary_scaling") or {}
        factor = scaling.get("factor", 1.0) if isinstance(scaling, dict) else 1.0
        bc.max_seq_len = int(mpe * max(float(factor), 1.0)) if mpe else 2048
    bc.max_input_len = min(bc.max_input_len, bc.max_seq_len)


def _copy_config(pc: PretrainedConfig) -> PretrainedConfig:
    return PretrainedConfig.from_dict(pc.to_dict(), pc.mapping.rank)
