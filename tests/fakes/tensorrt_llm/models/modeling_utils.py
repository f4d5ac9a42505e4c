"""PretrainedConfig and the checkpoint half of a model class (reference §1.1, §1.2).

Checkpoint layout: config.json (rank 0 writes it) plus rank{N}.safetensors per rank. The
fake's shards hold only the toy-model parameters and the shard's own mapping, never real
weights, so a checkpoint costs a few bytes whatever the model size.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from .._fake import env
from .._fake.toy import ToyModel
from ..mapping import Mapping

# The documented config.json fields (besides mapping, quantization and model extras).
CONFIG_FIELDS = (
    "architecture",
    "dtype",
    "logits_dtype",
    "vocab_size",
    "max_position_embeddings",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "intermediate_size",
    "norm_epsilon",
    "position_embedding_type",
)
_MAPPING_KEYS = ("world_size", "tp_size", "pp_size", "cp_size", "moe_tp_size", "moe_ep_size")
_TOY_KEY = "fake.toy_params"  # int64 [k, a, b, vocab_size]
_SHARD_KEY = "fake.shard"  # int64 [rank, tp_size, pp_size, cp_size]


class PretrainedConfig:
    """A checkpoint's config.json in memory; `mapping` says which rank this copy is for."""

    architecture: str
    dtype: str
    logits_dtype: str
    vocab_size: int
    max_position_embeddings: int | None
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_act: str
    intermediate_size: int
    norm_epsilon: float
    position_embedding_type: str
    mapping: Mapping
    quantization: dict[str, Any]
    extras: dict[str, Any]  # model-specific config.json fields

    def __init__(
        self,
        fields: dict[str, Any],
        mapping: Mapping,
        quantization: dict[str, Any],
        extras: dict[str, Any],
    ) -> None:
        missing = [f for f in CONFIG_FIELDS if f not in fields]
        if missing:
            raise ValueError(f"checkpoint config is missing fields {missing}")
        for name in CONFIG_FIELDS:
            setattr(self, name, fields[name])
        self.mapping = mapping
        self.quantization = dict(quantization)
        self.extras = dict(extras)

    def set_rank(self, rank: int, /) -> None:
        m = self.mapping
        self.mapping = Mapping(
            world_size=m.world_size,
            rank=rank,
            gpus_per_node=m.gpus_per_node,
            cp_size=m.cp_size,
            tp_size=m.tp_size,
            pp_size=m.pp_size,
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {name: getattr(self, name) for name in CONFIG_FIELDS}
        d.update(copy.deepcopy(self.extras))
        m = self.mapping
        d["mapping"] = {
            "world_size": m.world_size,
            "tp_size": m.tp_size,
            "pp_size": m.pp_size,
            "cp_size": m.cp_size,
            "moe_tp_size": m.tp_size if m.moe_tp_size == -1 else m.moe_tp_size,
            "moe_ep_size": 1 if m.moe_ep_size == -1 else m.moe_ep_size,
        }
        d["quantization"] = dict(self.quantization)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], rank: int = 0) -> PretrainedConfig:
        m = d.get("mapping", {})
        mapping = Mapping(
            world_size=m.get("world_size", 1),
            rank=rank,
            tp_size=m.get("tp_size", 1),
            pp_size=m.get("pp_size", 1),
            cp_size=m.get("cp_size", 1),
        )
        skip = {*CONFIG_FIELDS, "mapping", "quantization"}
        extras = {k: v for k, v in d.items() if k not in skip}
        return cls(
            {k: d[k] for k in CONFIG_FIELDS if k in d}, mapping, d.get("quantization", {}), extras
        )

    @classmethod
    def from_json_file(cls, config_file: str | Path) -> PretrainedConfig:
        return cls.from_dict(json.loads(Path(config_file).read_text()))

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path) -> PretrainedConfig:
        return cls.from_json_file(Path(ckpt_dir) / "config.json")


class PretrainedModel:
    """Base of the fake model classes: a config plus this rank's (toy) weights."""

    config: PretrainedConfig

    def __init__(self, config: PretrainedConfig, toy: ToyModel) -> None:
        self.config = config
        self._toy = toy

    @classmethod
    def from_checkpoint(
        cls, ckpt_dir: str | Path, /, *, config: PretrainedConfig
    ) -> PretrainedModel:
        from . import MODEL_MAP

        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"config must be a PretrainedConfig, got {type(config).__name__}")
        if MODEL_MAP.get(config.architecture) is not cls:
            raise ValueError(f"architecture {config.architecture!r} is not {cls.__name__}")
        m = config.mapping
        path = Path(ckpt_dir) / f"rank{m.rank}.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint shard not found: {path}")
        tensors = load_file(str(path))
        shard = [int(x) for x in tensors[_SHARD_KEY]]
        if shard != [m.rank, m.tp_size, m.pp_size, m.cp_size]:
            raise ValueError(
                f"{path} was written for rank/tp/pp/cp {shard}, config says "
                f"{[m.rank, m.tp_size, m.pp_size, m.cp_size]}"
            )
        k, a, b, vocab = (int(x) for x in tensors[_TOY_KEY])
        return cls(copy.deepcopy(config), ToyModel(k=k, a=a, b=b, vocab_size=vocab))

    def save_checkpoint(self, output_dir: str | Path, /, save_config: bool) -> None:
        out = Path(output_dir)
        env.trace("save_checkpoint", dir=str(out))
        out.mkdir(parents=True, exist_ok=True)
        m = self.config.mapping
        t = self._toy
        save_file(
            {
                _TOY_KEY: np.array([t.k, t.a, t.b, t.vocab_size], dtype=np.int64),
                _SHARD_KEY: np.array([m.rank, m.tp_size, m.pp_size, m.cp_size], dtype=np.int64),
            },
            str(out / f"rank{m.rank}.safetensors"),
        )
        if save_config:
            (out / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))


@dataclasses.dataclass(kw_only=True)
class QuantConfig:
    """The checkpoint's `quantization` section as an object (§1.1: quant_algo,
    kv_cache_quant_algo, group_size, has_zero_point, pre_quant_scale, exclude_modules)."""

    quant_algo: Any = None  # a QuantAlgo, or None
    kv_cache_quant_algo: Any = None
    group_size: int = 128
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list[str] | None = None


def quantization_section(qc: QuantConfig) -> dict[str, Any]:
    """The checkpoint config.json's `quantization` object for a QuantConfig (fake machinery)."""
    d = dataclasses.asdict(qc)
    for k in ("quant_algo", "kv_cache_quant_algo"):
        d[k] = None if d[k] is None else str(d[k])
    return d
