"""LLaMAForCausalLM: Hugging Face Llama-family checkpoint -> TensorRT-LLM checkpoint (§1.1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..._fake.toy import ToyModel
from ...mapping import Mapping
from ...quantization import LOAD_TIME_ALGOS, QuantAlgo
from ..modeling_utils import PretrainedConfig, PretrainedModel, QuantConfig, quantization_section

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM")
_DTYPES = ("auto", "float16", "bfloat16", "float32")
_REQUIRED_HF = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)
_QUANT_NONE = {
    "quant_algo": None,
    "kv_cache_quant_algo": None,
    "group_size": 128,
    "has_zero_point": False,
    "pre_quant_scale": False,
    "exclude_modules": None,
}


class LLaMAForCausalLM(PretrainedModel):
    @classmethod
    def from_hugging_face(
        cls,
        hf_model_or_dir: str | Path,
        dtype: str,
        /,
        mapping: Mapping | None = None,
        quant_config: Any = None,
        **kwargs: Any,
    ) -> LLaMAForCausalLM:
        hf_dir = Path(hf_model_or_dir)
        hf = _read_hf_config(hf_dir)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
        if mapping is None:
            mapping = Mapping()
        if not isinstance(mapping, Mapping):
            raise TypeError(f"mapping must be a tensorrt_llm.Mapping, got {type(mapping).__name__}")
        quantization = _quantization(quant_config)
        kwargs.pop("load_by_shard", None)  # a loading strategy, not part of the config
        fields = {
            "architecture": hf["architectures"][0],
            "dtype": _resolve_dtype(dtype, hf),
            "logits_dtype": "float32",
            "vocab_size": hf["vocab_size"],
            "max_position_embeddings": hf.get("max_position_embeddings"),
            "hidden_size": hf["hidden_size"],
            "num_hidden_layers": hf["num_hidden_layers"],
            "num_attention_heads": hf["num_attention_heads"],
            "num_key_value_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "hidden_act": hf.get("hidden_act", "silu"),
            "intermediate_size": hf["intermediate_size"],
            "norm_epsilon": hf.get("rms_norm_eps", 1e-6),
            "position_embedding_type": "rope_gpt_neox",
        }
        rope = hf.get("rope_parameters") or {}
        extras: dict[str, Any] = {
            "rotary_base": hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
            "rotary_scaling": hf.get("rope_scaling"),
            "use_parallel_embedding": False,
            "embedding_sharding_dim": 0,
        }
        extras.update(kwargs)
        config = PretrainedConfig(fields, mapping, quantization, extras)
        return cls(config, ToyModel.for_checkpoint(hf_dir, int(hf["vocab_size"])))


def _quantization(quant_config: Any) -> dict[str, Any]:
    """The checkpoint's `quantization` section: from_hugging_face quantizes while loading
    only what needs no calibration (weight-only W8A16/W4A16, FP8 from the weights' ranges)."""
    if quant_config is None:
        return dict(_QUANT_NONE)
    if not isinstance(quant_config, QuantConfig):
        raise TypeError(f"quant_config must be a QuantConfig, got {type(quant_config).__name__}")
    algo = quant_config.quant_algo
    if algo is not None and not isinstance(algo, QuantAlgo):
        raise TypeError(f"quant_algo must be a QuantAlgo, got {algo!r}")
    if algo is not None and algo not in LOAD_TIME_ALGOS:
        raise ValueError(f"from_hugging_face cannot quantize {algo} without calibration "
                         "(LLaMAForCausalLM.quantize)")
    return {**_QUANT_NONE, **quantization_section(quant_config)}


def _read_hf_config(hf_dir: Path) -> dict[str, Any]:
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no Hugging Face config.json in {hf_dir}")
    hf = json.loads(cfg_path.read_text())
    arch = (hf.get("architectures") or [None])[0]
    if arch not in LLAMA_FAMILY:
        raise ValueError(f"LLaMAForCausalLM cannot convert architecture {arch!r}")
    missing = [k for k in _REQUIRED_HF if k not in hf]
    if missing:
        raise ValueError(f"{cfg_path} lacks {missing}")
    if not any(f.suffix in (".safetensors", ".bin") for f in hf_dir.iterdir()):
        raise FileNotFoundError(f"no weight files (*.safetensors, *.bin) in {hf_dir}")
    return hf


def _resolve_dtype(dtype: str, hf: dict[str, Any]) -> str:
    if dtype != "auto":
        return dtype
    hf_dtype = hf.get("torch_dtype") or hf.get("dtype")
    return hf_dtype if hf_dtype in ("float16", "bfloat16", "float32") else "float16"
