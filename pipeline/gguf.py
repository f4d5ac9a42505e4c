"""GGUF sources: check the file, dequantize it once into a Hugging Face checkpoint in the
cache (keyed by the file's sha256), and resolve to that checkpoint."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

from contract.errors import EXIT_BAD_INPUT, EXIT_FAILURE, BuildError
from contract.manifest import hash_file
from pipeline.progress import Progress
from pipeline.resolve import ResolvedSource, check_checkpoint, safe_name
from pipeline.store import clean_stale, is_disk_full, staging_dir

COMPLETE_MARKER = ".complete"


def resolve_gguf(
    uri: str, path: Path, cache_dir: Path, progress: Progress | None
) -> ResolvedSource:
    check_gguf(path)
    progress = progress or Progress.silent()
    with progress.stage("digest gguf", total=path.stat().st_size, unit="B") as st:
        sha = hash_file(path, st.advance)
    out = cache_dir / "gguf" / f"{safe_name(path.stem)}-{sha[:16]}"
    clean_stale(out.parent)  # what dequantizations that were killed left, cache hit or not
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


def _cache_error(cache: Path, e: BaseException) -> BuildError:
    if is_disk_full(e):
        return BuildError(
            f"disk full while writing the dequantized checkpoint to {cache}",
            "free some space or set AOT_LLM_CACHE to a larger disk; nothing was left behind",
            exit_code=EXIT_FAILURE,
        )
    reason = e.strerror if isinstance(e, OSError) and e.strerror else e
    return BuildError(
        f"cannot write the checkpoint cache {cache} ({reason})",
        "set AOT_LLM_CACHE to a directory you can write to",
        exit_code=EXIT_BAD_INPUT,
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
    progress = progress or Progress.silent()
    with contextlib.ExitStack() as stack:
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            # Locked like an engine's staging directory: what a killed run left is removed here.
            tmp = stack.enter_context(staging_dir(out_dir.parent, out_dir.name))
        except OSError as e:
            raise _cache_error(out_dir.parent, e) from e
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
            try:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                (tmp / COMPLETE_MARKER).write_text(
                    json.dumps({"gguf": gguf.name, "dtype": "float32"}) + "\n"
                )
            except Exception as e:
                if is_disk_full(e):
                    raise _cache_error(out_dir.parent, e) from e
                raise
        if out_dir.exists() and not (out_dir / COMPLETE_MARKER).is_file():
            shutil.rmtree(out_dir)  # left by a run that predates the marker or was tampered with
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / COMPLETE_MARKER).is_file():  # not a concurrent twin that won
                raise
    return out_dir
