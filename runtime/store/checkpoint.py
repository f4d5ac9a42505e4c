"""Reading checkpoints: a Hugging Face directory's config and safetensors weights, and an
engine's model config. Used by the build (convert) and by in-process runners (tests, bench).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from contract.errors import BuildError
from contract.layout import ENGINE_CONFIG
from contract.quant import NONE, Quantization
from runtime.models.config import ModelConfig

TensorGetter = Callable[[str], torch.Tensor]


def read_model_config(src: Path) -> tuple[ModelConfig, dict]:
    """A Hugging Face checkpoint's config.json -> (ModelConfig, the raw dict)."""
    path = src / "config.json"
    try:
        hf_cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise BuildError(f"{src} has no config.json", "point MODEL at a Hugging Face checkpoint directory") from None
    except (OSError, json.JSONDecodeError) as e:
        raise BuildError(f"cannot read {path}: {e}", "re-download or repair the checkpoint") from None
    return ModelConfig.from_hf_config(hf_cfg), hf_cfg


def open_weights(src: Path) -> TensorGetter:
    """name -> tensor over every *.safetensors file of a checkpoint (read lazily)."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise BuildError(
            f"{src} has no *.safetensors weights",
            "save the checkpoint with safe_serialization=True (the default of save_pretrained)",
        )
    where: dict[str, object] = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
        except (SafetensorError, OSError) as e:
            raise BuildError(f"corrupt weights file {f.name}: {e}", "re-download or re-save the checkpoint") from None
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            where[name] = handle

    def get(name: str) -> torch.Tensor:
        handle = where.get(name)
        if handle is None:
            raise BuildError(
                f"the checkpoint has no tensor {name!r}",
                "the weights are incomplete or not of the architecture config.json names",
            )
        try:
            return handle.get_tensor(name)  # type: ignore[attr-defined]
        except (SafetensorError, OSError) as e:
            raise BuildError(f"cannot read tensor {name!r}: {e}", "re-download the checkpoint") from None

    return get


def write_engine_model_config(engine_dir: Path, cfg: ModelConfig, hf_cfg: dict, name: str = ENGINE_CONFIG,
                              quant: Quantization = NONE, weight_layout: str = "rows") -> None:
    data = {"model": cfg.to_dict(), "hf_config": hf_cfg}
    if quant.enabled:  # what the weights in the shards are (the manifest records it too)
        data["quant"] = quant.to_dict()
    if weight_layout != "rows":  # how they are laid out (contract/layout.py)
        data["weight_layout"] = weight_layout
    (engine_dir / name).write_text(json.dumps(data, indent=2, sort_keys=True))


def load_engine_model_config(engine_dir: Path, name: str = ENGINE_CONFIG) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((engine_dir / name).read_text())["model"])


def load_engine_quant(engine_dir: Path, name: str = ENGINE_CONFIG) -> Quantization:
    return Quantization.from_dict(json.loads((engine_dir / name).read_text()).get("quant"))
