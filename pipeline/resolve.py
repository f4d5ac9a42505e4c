"""Turn what the user typed (a directory, hf://org/name@rev, a .gguf file) into a checked local
Hugging Face checkpoint with an immutable revision, and digest it.

Everything here is checked before any heavy work: a missing config or shard, a truncated
safetensors file or an unreadable GGUF is a one-line BuildError, not a traceback from deep
inside the converter.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from contract.errors import EXIT_FAILURE, BuildError
from contract.layout import TOKENIZER_FILES
from pipeline.checkpoint import (
    CONFIG_FILES,
    WEIGHT_GLOB,
    ResolvedSource,
    check_checkpoint,
    safe_name,
)
from pipeline.progress import Progress
from runtime.env import cache_root  # $AOT_LLM_CACHE; build and compile/ import it from here

# What an hf:// snapshot needs; keeps us from downloading .bin, .gguf or onnx copies too.
HF_ALLOW_PATTERNS = [WEIGHT_GLOB, *CONFIG_FILES, *TOKENIZER_FILES]
_HF_URI = re.compile(r"^hf://(?P<repo>[^/@]+/[^/@]+)(?:@(?P<rev>.*))?$")
# The Hub's rules for a repo id part: letters, digits, '-', '_', '.'; neither starting nor
# ending with '-' or '.'; no '--' or '..'; at most 96 characters for the whole id.
_HF_NAME = re.compile(r"^[A-Za-z0-9_](?:[\w.-]*[A-Za-z0-9_])?$")
# A branch, tag or commit: git's ref rules, as far as a path component in the cache goes.
_HF_REV = re.compile(r"^[\w.-]+(?:/[\w.-]+)*$")


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


