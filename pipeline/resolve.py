"""Turn what the user typed (a directory, hf://org/name@rev, a .gguf file) into a checked local
Hugging Face checkpoint with an immutable revision, and digest it.

Everything here is checked before any heavy work: a missing config or shard, a truncated
safetensors file or an unreadable GGUF is a one-line BuildError, not a traceback from deep
inside the converter.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from contract.errors import EXIT_FAILURE, BuildError
from contract.layout import TOKENIZER_FILES
from contract.manifest import CHUNK
from pipeline.progress import Progress
from runtime.env import cache_root  # $AOT_LLM_CACHE; build and compile/ import it from here

# Files that make up a checkpoint's identity: weights, architecture, tokenizer, chat template.
WEIGHT_GLOB = "*.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json", INDEX_FILE)
# What an hf:// snapshot needs; keeps us from downloading .bin, .gguf or onnx copies too.
HF_ALLOW_PATTERNS = [WEIGHT_GLOB, *CONFIG_FILES, *TOKENIZER_FILES]
_HF_URI = re.compile(r"^hf://(?P<repo>[^/@]+/[^/@]+)(?:@(?P<rev>.*))?$")
# The Hub's rules for a repo id part: letters, digits, '-', '_', '.'; neither starting nor
# ending with '-' or '.'; no '--' or '..'; at most 96 characters for the whole id.
_HF_NAME = re.compile(r"^[A-Za-z0-9_](?:[\w.-]*[A-Za-z0-9_])?$")
# A branch, tag or commit: git's ref rules, as far as a path component in the cache goes.
_HF_REV = re.compile(r"^[\w.-]+(?:/[\w.-]+)*$")


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


def resolve(
    model: str, cache_dir: Path | None = None, progress: Progress | None = None
) -> ResolvedSource:
    cache_dir = cache_dir if cache_dir is not None else cache_root()
    if model.startswith("hf://"):
        return _resolve_hf(model)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        from pipeline.gguf import resolve_gguf

        return resolve_gguf(model, path, cache_dir, progress)
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


def parse_hf_uri(uri: str) -> tuple[str, str]:
    """hf://org/name[@revision] -> (repo id, revision; "main" when none is given)."""
    usage = "write it as hf://org/name or hf://org/name@revision"
    m = _HF_URI.match(uri)
    if not m:
        raise BuildError(f"cannot parse {uri!r}", usage)
    repo, rev = m["repo"], m["rev"]
    bad_part = next(
        (part for part in repo.split("/") if not _HF_NAME.match(part) or "--" in part or ".." in part),
        None,
    )
    if bad_part is not None or len(repo) > 96:
        raise BuildError(
            f"cannot parse {uri!r}: {repo!r} is not a Hugging Face repo id",
            "org and name use letters, digits, '-', '_' and '.', and neither starts nor ends "
            "with '-' or '.'; " + usage,
        )
    if rev is not None and (not _HF_REV.match(rev) or ".." in rev or rev.endswith(".lock")):
        raise BuildError(
            f"cannot parse {uri!r}: {rev!r} is not a branch, tag or commit",
            "give an existing branch, tag or commit after '@'",
        )
    return repo, rev or "main"


def _resolve_hf(uri: str) -> ResolvedSource:
    repo, rev = parse_hf_uri(uri)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
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
    except HFValidationError as e:  # the Hub's own check, should ours ever fall behind it
        raise BuildError(
            f"cannot parse {uri!r} ({e})", "write it as hf://org/name or hf://org/name@revision"
        ) from e
    except LocalEntryNotFoundError as e:
        where = cache or constants.HF_HUB_CACHE
        if offline:
            raise BuildError(
                f"{repo}@{rev} is not in the local Hugging Face cache ({where}) and "
                "HF_HUB_OFFLINE forbids downloading it",
                "download it once with HF_HUB_OFFLINE unset, or set HF_HUB_CACHE to a cache "
                "holding it",
                exit_code=EXIT_FAILURE,
            ) from e
        # Online, the hub raises this when it cannot reach the endpoint and has no cached copy.
        raise BuildError(
            f"cannot reach {constants.ENDPOINT} to download {repo}@{rev}, and it is not in the "
            f"local Hugging Face cache ({where})",
            "check the network (or HF_ENDPOINT) and retry, or set HF_HUB_CACHE to a cache "
            "holding it",
            exit_code=EXIT_FAILURE,
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise BuildError(
            f"cannot download {repo}@{rev}: {e}",
            "check the network and retry",
            exit_code=EXIT_FAILURE,
        ) from e
    # A snapshot folder is named by its commit sha: that is the immutable revision.
    commit = path.name
    check_checkpoint(path)
    return ResolvedSource(
        uri=uri, local_dir=path, revision=commit, kind="hf", name=safe_name(repo.split("/")[1])
    )


