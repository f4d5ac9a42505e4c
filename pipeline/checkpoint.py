"""A local Hugging Face checkpoint: what a resolved source is, the files that make up its
identity, their checks (before any heavy work: a missing config or shard, a truncated
safetensors file is a one-line BuildError) and their digest.

`pipeline.resolve` turns what the user typed into one; `pipeline.gguf` makes one from a .gguf.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from contract.errors import BuildError
from contract.layout import TOKENIZER_FILES
from contract.manifest import CHUNK
from pipeline.progress import Progress

# Files that make up a checkpoint's identity: weights, architecture, tokenizer, chat template.
WEIGHT_GLOB = "*.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json", INDEX_FILE)

@dataclass(frozen=True, slots=True)
class ResolvedSource:
    uri: str  # as the user gave it
    local_dir: Path  # a Hugging Face checkpoint directory on this machine
    revision: str | None  # hf: the commit sha; gguf: "sha256:<file digest>"; local: None
    kind: str  # "local" | "hf" | "gguf"
    name: str  # the model name engines are stored under
    gguf_file: Path | None = None  # the .gguf itself (kind "gguf"): quantized blocks come from it
    format: str = ""  # gguf: its block types (manifest source.format)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"


def check_checkpoint(local_dir: Path) -> None:
    """Refuse a checkpoint whose config is missing or unparsable, or whose weights are missing,
    truncated or corrupt (headers only: cheap, and catches the usual half-copied file)."""
    config = local_dir / "config.json"
    if not config.is_file():
        raise BuildError(
            f"{local_dir} has no config.json",
            "give a complete Hugging Face checkpoint (config.json and *.safetensors weights)",
        )
    try:
        json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BuildError(
            f"{config} is not valid JSON ({e})", "re-download or re-save the checkpoint"
        ) from e
    weights = sorted(local_dir.glob(WEIGHT_GLOB))
    index = local_dir / INDEX_FILE
    if index.is_file():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
            # Shards are plain file names beside the index; anything else is not an HF index.
            if not all(isinstance(w, str) and w and "/" not in w and w not in (".", "..")
                       for w in wanted):
                raise ValueError("weight_map names something other than a file beside it")
        except (OSError, KeyError, AttributeError, TypeError, ValueError) as e:
            raise BuildError(
                f"{index} is not a valid safetensors index ({e.__class__.__name__}: {e})",
                "re-download the checkpoint",
            ) from e
        missing = sorted(w for w in wanted if not (local_dir / w).is_file())
        if missing:
            raise BuildError(
                f"{local_dir} is missing weight shards named by {INDEX_FILE}: {', '.join(missing)}",
                "re-download the checkpoint; the copy is incomplete",
            )
    if not weights:
        other = sorted(p.name for p in local_dir.glob("*.bin")) + sorted(
            p.name for p in local_dir.glob("*.pt")
        )
        found = f" (found {', '.join(other)}, which is not supported)" if other else ""
        raise BuildError(
            f"{local_dir} has no *.safetensors weights{found}",
            "give a checkpoint saved with safetensors (save_pretrained does so by default)",
        )
    for w in weights:
        check_safetensors(w)


def check_safetensors(path: Path) -> None:
    """Parse the header and check that the data section has exactly the size it declares
    (safetensors refuses a file its header does not cover exactly)."""
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise BuildError(
            f"{path} is not a valid safetensors file ({' '.join(str(e).split())})",
            "the file is truncated or corrupt; re-download or re-save the checkpoint",
        ) from e


def checkpoint_files(local_dir: Path) -> list[Path]:
    names = [*CONFIG_FILES, *TOKENIZER_FILES]
    files = [local_dir / n for n in names if (local_dir / n).is_file()]
    files += local_dir.glob(WEIGHT_GLOB)
    return sorted(set(files), key=lambda p: p.relative_to(local_dir).as_posix())


def checkpoint_digest(local_dir: Path, progress: Progress | None = None) -> str:
    """sha256 over each identity file's relative path, size and contents, in sorted order."""
    files = checkpoint_files(local_dir)
    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in files)
    progress = progress or Progress.silent()
    with progress.stage("digest", total=total, unit="B") as st:
        for p in files:
            rel = p.relative_to(local_dir).as_posix().encode()
            h.update(struct.pack("<Q", len(rel)) + rel + struct.pack("<Q", p.stat().st_size))
            with p.open("rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    st.advance(len(chunk))
    return h.hexdigest()


