"""Turn what the user typed (a directory, hf://org/name@rev, a .gguf file) into a checked local
Hugging Face checkpoint with an immutable revision, and digest it.

Everything here is checked before any heavy work: a missing config or shard, a truncated
safetensors file or an unreadable GGUF is a one-line BuildError, not a traceback from deep
inside the converter.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import BuildError
from pipeline.manifest import CHUNK, hash_file
from pipeline.progress import Progress

# Files that make up a checkpoint's identity: weights, architecture, tokenizer, chat template.
WEIGHT_GLOB = "*.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json", INDEX_FILE)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# What an hf:// snapshot needs; keeps us from downloading .bin, .gguf or onnx copies too.
HF_ALLOW_PATTERNS = [WEIGHT_GLOB, *CONFIG_FILES, *TOKENIZER_FILES]
COMPLETE_MARKER = ".complete"
_HF_URI = re.compile(r"^hf://(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")


@dataclass(frozen=True, slots=True)
class ResolvedSource:
    uri: str  # as the user gave it
    local_dir: Path  # a Hugging Face checkpoint directory on this machine
    revision: str | None  # hf: the commit sha; gguf: "sha256:<file digest>"; local: None
    kind: str  # "local" | "hf" | "gguf"
    name: str  # the model name engines are stored under


def cache_root() -> Path:
    """Where downloaded and dequantized checkpoints live ($AOT_LLM_CACHE or ~/.cache/aot-llm)."""
    env = os.environ.get("AOT_LLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "aot-llm"


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"


def resolve(
    model: str, cache_dir: Path | None = None, progress: Progress | None = None
) -> ResolvedSource:
    cache_dir = cache_dir if cache_dir is not None else cache_root()
    if model.startswith("hf://"):
        return _resolve_hf(model)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return _resolve_gguf(model, path, cache_dir, progress)
    if not path.exists():
        raise BuildError(
            f"model {model!r} does not exist",
            "give a Hugging Face checkpoint directory, hf://org/name@revision, or a .gguf file",
        )
    if not path.is_dir():
        raise BuildError(
            f"model {model!r} is a file, not a checkpoint directory",
            "give the directory holding config.json and *.safetensors, or a .gguf file",
        )
    local = path.resolve()
    check_checkpoint(local)
    return ResolvedSource(
        uri=model, local_dir=local, revision=None, kind="local", name=safe_name(local.name)
    )


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
        except (OSError, KeyError, AttributeError, json.JSONDecodeError) as e:
            raise BuildError(
                f"{index} is not a valid safetensors index ({e})", "re-download the checkpoint"
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
    """Parse the header and check that the data section has exactly the size it declares."""
    remedy = "the file is truncated or corrupt; re-download or re-save the checkpoint"
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BuildError(f"{path} is not a safetensors file (only {size} bytes)", remedy)
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise BuildError(f"{path} is not a safetensors file (bad header length)", remedy)
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BuildError(
            f"{path} is not a safetensors file ({e.__class__.__name__})", remedy
        ) from e
    if not isinstance(header, dict):
        raise BuildError(f"{path} is not a safetensors file (header is not a table)", remedy)
    try:
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise BuildError(f"{path} has a malformed safetensors header ({e})", remedy) from e
    if 8 + n + max(ends, default=0) != size:
        raise BuildError(
            f"{path} is corrupt: its header describes {8 + n + max(ends, default=0)} bytes "
            f"but the file has {size}",
            remedy,
        )


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


def _resolve_hf(uri: str) -> ResolvedSource:
    m = _HF_URI.match(uri)
    if not m:
        raise BuildError(
            f"cannot parse {uri!r}", "write it as hf://org/name or hf://org/name@revision"
        )
    repo, rev = m["repo"], m["rev"] or "main"
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # The hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once at import; read them at call time so
    # a caller that sets them later (a test, a wrapper script) is honoured too.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    cache = os.environ.get("HF_HUB_CACHE") or None
    try:
        path = Path(
            snapshot_download(
                repo,
                revision=rev,
                cache_dir=cache,
                local_files_only=offline,
                allow_patterns=HF_ALLOW_PATTERNS,
            )
        )
    except RevisionNotFoundError as e:
        raise BuildError(
            f"{repo} has no revision {rev!r}", "give an existing branch, tag or commit"
        ) from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise BuildError(
            f"cannot access Hugging Face repo {repo} ({e.__class__.__name__})",
            "check the name, and log in with `hf auth login` if it is gated or private",
        ) from e
    except LocalEntryNotFoundError as e:
        raise BuildError(
            f"{repo}@{rev} is not in the local Hugging Face cache and downloads are disabled",
            "download it once with HF_HUB_OFFLINE unset, or set HF_HUB_CACHE to a cache holding it",
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise BuildError(f"cannot download {repo}@{rev}: {e}", "check the network and retry") from e
    # A snapshot folder is named by its commit sha: that is the immutable revision.
    commit = path.name
    check_checkpoint(path)
    return ResolvedSource(
        uri=uri, local_dir=path, revision=commit, kind="hf", name=safe_name(repo.split("/")[1])
    )


def _resolve_gguf(
    uri: str, path: Path, cache_dir: Path, progress: Progress | None
) -> ResolvedSource:
    check_gguf(path)
    sha = hash_file(path, progress, label="digest gguf")
    out = cache_dir / "gguf" / f"{safe_name(path.stem)}-{sha[:16]}"
    if not (out / COMPLETE_MARKER).is_file():
        dequantize_gguf(path, out, progress)
    check_checkpoint(out)
    return ResolvedSource(
        uri=uri, local_dir=out, revision=f"sha256:{sha}", kind="gguf", name=safe_name(path.stem)
    )


def check_gguf(path: Path) -> None:
    if not path.is_file():
        raise BuildError(f"GGUF file {path} does not exist", "check the path")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise BuildError(
            f"cannot read GGUF file {path} ({e.strerror})", "check the file's permissions"
        ) from e
    if magic != b"GGUF":
        raise BuildError(
            f"{path} is not a GGUF file (bad magic {magic!r})", "give a complete .gguf model file"
        )


def dequantize_gguf(gguf: Path, out_dir: Path, progress: Progress | None = None) -> Path:
    """Dequantize a GGUF into a float32 Hugging Face checkpoint (with tokenizer) at ``out_dir``.

    Written to a temporary sibling and renamed, with a completion marker, so an interrupted
    run is redone rather than reused. float32 because Q4/Q8 blocks dequantize (scale x int +
    min) exactly in float32 and not in bfloat16; the build casts to the engine dtype anyway.
    """
    check_gguf(gguf)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    progress = progress or Progress.silent()
    try:
        with progress.stage("dequantize gguf"):
            try:
                # The GGUF loader draws its own tqdm bar, which ignores transformers' switch.
                with contextlib.redirect_stderr(io.StringIO()):
                    model = AutoModelForCausalLM.from_pretrained(
                        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
                    )
                    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            except Exception as e:  # transformers raises many types for a bad file
                raise BuildError(
                    f"cannot read GGUF file {gguf}: {e.__class__.__name__}: {e}",
                    "give a complete llama-family .gguf file that transformers can dequantize",
                ) from e
            # The loaded model still says it is GGUF-quantized; saving it so would make
            # from_pretrained look for a GGUF again. Drop both traces of the quantizer.
            if getattr(model.config, "quantization_config", None) is not None:
                del model.config.quantization_config
            if hasattr(model, "hf_quantizer"):
                del model.hf_quantizer
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / COMPLETE_MARKER).write_text(
                json.dumps({"gguf": gguf.name, "dtype": "float32"}) + "\n"
            )
        if out_dir.exists() and not (out_dir / COMPLETE_MARKER).is_file():
            shutil.rmtree(out_dir)  # left by a run that predates the marker or was tampered with
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / COMPLETE_MARKER).is_file():  # not a concurrent twin that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
