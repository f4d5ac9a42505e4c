"""Convert a Hugging Face checkpoint into per-rank shards following the sharding rule."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pipeline.errors import BuildError
from pipeline.models.config import ModelConfig
from pipeline.models.factory import torch_dtype
from pipeline.models.sharding import rules_for, shard_state_dict
from pipeline.progress import Progress

ENGINE_CONFIG = "config.json"


def read_model_config(src: Path) -> tuple[ModelConfig, dict]:
    path = src / "config.json"
    try:
        hf_cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise BuildError(f"{src} has no config.json", "point MODEL at a Hugging Face checkpoint directory") from None
    except (OSError, json.JSONDecodeError) as e:
        raise BuildError(f"cannot read {path}: {e}", "re-download or repair the checkpoint") from None
    return ModelConfig.from_hf_config(hf_cfg), hf_cfg


def _open_weights(src: Path) -> Callable[[str], torch.Tensor]:
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


def convert_checkpoint(
    src: Path, out_dir: Path, tp: int, dtype: str, progress: Progress | None = None
) -> ModelConfig:
    """Write out_dir/rank{N}.safetensors for every rank and out_dir/config.json."""
    progress = progress or Progress.silent()
    cfg, hf_cfg = read_model_config(src)
    cfg.check_tp(tp)
    get = _open_weights(src)
    td = torch_dtype(dtype)
    with progress.stage("convert", total=tp * len(rules_for(cfg)), unit="tensors") as st:
        for rank in range(tp):
            shard = shard_state_dict(get, cfg, tp, rank, td)
            st.advance(len(shard) - 2)
            save_file(shard, str(out_dir / f"rank{rank}.safetensors"), metadata={"rank": str(rank), "tp": str(tp)})
            del shard
    (out_dir / ENGINE_CONFIG).write_text(
        json.dumps({"model": cfg.to_dict(), "hf_config": hf_cfg}, indent=2, sort_keys=True)
    )
    return cfg


def load_engine_model_config(engine_dir: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((engine_dir / ENGINE_CONFIG).read_text())["model"])
