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
from pipeline.checkpoint import ResolvedSource, check_checkpoint, safe_name
from pipeline.progress import Progress
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
        uri=uri, local_dir=out, revision=f"sha256:{sha}", kind="gguf", name=safe_name(path.stem),
        gguf_file=path, format=_marked_format(out, path),
    )


def _marked_format(out: Path, path: Path) -> str:
    """The block types the dequantization recorded; read again from a cache entry made
    before it recorded them."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if fmt := json.loads((out / COMPLETE_MARKER).read_text()).get("format"):
            return str(fmt)
    try:
        return gguf_format(path)
    except Exception:  # the gguf reader raises many types; the record is not worth a refusal
        return "GGUF"


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


def gguf_format(path: Path, reader=None) -> str:
    """What the GGUF stores its tensors as: "GGUF Q4_K_M: F32 x109, Q4_K x27, ..."."""
    from collections import Counter

    from gguf import GGUFReader, LlamaFileType

    reader = reader or GGUFReader(str(path))
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    label = "GGUF"
    if (ft := reader.fields.get("general.file_type")) is not None:
        with contextlib.suppress(ValueError, TypeError):
            label += " " + LlamaFileType(int(ft.contents())).name.removeprefix("MOSTLY_")
    return f"{label}: " + ", ".join(f"{t} x{n}" for t, n in sorted(counts.items()))


def _read_gguf(gguf: Path):  # -> (config, tokenizer, {hf name: float32 tensor}, format)
    """The GGUF as transformers reads it (config, tokenizer, tensor names and the fix-ups of
    its TensorProcessors: Llama's q/k rows, Gemma's norms stored as 1 + w), but every block
    dequantized by pipeline/gguf_blocks.py (bit-exact, vectorized) instead of numpy one
    tensor type at a time. Loading the model with ``gguf_file=`` gives the same tensors."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from pipeline.gguf_blocks import dequantize

    where = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(**where)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    # Each parse of the metadata (262,144 token strings for Gemma) costs seconds: the processors
    # get the config's own keys, which are the ones they read (head counts, experts).
    parsed: dict = {"tensors": {}}
    reader = GGUFReader(str(gguf))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    text_config = config.get_text_config()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=text_config.to_dict())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(skeleton, processor)
    for t in reader.tensors:
        try:
            w = dequantize(t.data, t.tensor_type.name).numpy()
        except NotImplementedError as e:
            raise BuildError(f"{gguf.name}: {t.name} is {t.tensor_type.name}, which we do not "
                             "dequantize", "requantize it with llama-quantize to a K-quant "
                             "(Q4_K_M, Q5_K_M, Q6_K) or Q8_0") from e
        r = processor.process(weights=w, name=t.name, tensor_key_mapping=names,
                              parsed_parameters=parsed)
        if r.name in names:
            parsed["tensors"][names[r.name]] = torch.from_numpy(np.ascontiguousarray(r.weights))
    tensors = parsed["tensors"]
    wanted = set(skeleton.state_dict())
    if text_config.tie_word_embeddings:
        wanted.discard("lm_head.weight")
        tensors.pop("lm_head.weight", None)
    missing = sorted(wanted - set(tensors))
    if missing:
        raise BuildError(f"{gguf.name} has no tensor for {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}", "give a complete GGUF file")
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    for k, v in tensors.items():
        if k in shapes and tuple(v.shape) != shapes[k]:
            raise BuildError(f"{gguf.name}: {k} is {tuple(v.shape)}, the config says {shapes[k]}",
                             "give a GGUF whose metadata matches its tensors")
    config.architectures = [type(skeleton).__name__]
    config.dtype = "float32"
    kept = {k: v for k, v in tensors.items() if k in wanted}
    return config, tokenizer, kept, gguf_format(gguf, reader)


def dequantize_gguf(gguf: Path, out_dir: Path, progress: Progress | None = None) -> Path:
    """Dequantize a GGUF into a float32 Hugging Face checkpoint (with tokenizer) at ``out_dir``.

    Written to a temporary sibling and renamed, with a completion marker, so an interrupted
    run is redone rather than reused. float32 because the blocks (Q4/Q5/Q8 and the K-quants:
    scale x int - min) dequantize exactly in float32 and not in bfloat16; the build casts to
    the engine dtype anyway.
    """
    check_gguf(gguf)
    import transformers
    from safetensors.torch import save_file
    from transformers import GenerationConfig

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
                # transformers' GGUF reading draws its own tqdm bars, which ignore its switch.
                with contextlib.redirect_stderr(io.StringIO()):
                    config, tokenizer, tensors, fmt = _read_gguf(gguf)
            except BuildError:
                raise
            except Exception as e:  # transformers raises many types for a bad file
                raise BuildError(
                    f"cannot read GGUF file {gguf}: {e.__class__.__name__}: {e}",
                    "give a complete .gguf file of an architecture transformers reads",
                ) from e
            try:
                save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
                config.save_pretrained(tmp)
                GenerationConfig.from_model_config(config).save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                (tmp / COMPLETE_MARKER).write_text(
                    json.dumps({"gguf": gguf.name, "dtype": "float32", "format": fmt}) + "\n"
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


# ---- quantized blocks taken over unchanged (--quant with a .gguf source) -------------------

# llama.cpp tensor names -> Hugging Face names ({i}: the layer).
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_LINEAR_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
# GGUF block type -> (our kind, zero point); all three use blocks of 32 along K.
_BLOCK_TYPES = {"Q8_0": ("int8", False), "Q4_0": ("int4", False), "Q4_1": ("int4", True)}
_SCHEME_OF_KIND = {"int8": "int8_wo", "int4": "int4_wo"}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name.startswith("blk."):
        _, i, rest = gguf_name.split(".", 2)
        hf = _GGUF_NAMES.get(f"blk.{{i}}.{rest}")
        return hf.format(i=i) if hf else None
    return _GGUF_NAMES.get(gguf_name)


def _types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def gguf_quantization(path: Path, scheme: str, tied: bool):  # -> Quantization
    """The engine quantization that holds this GGUF's blocks exactly, or a refusal.

    Linears: all Q8_0 -> int8_wo (groups of 32); Q4_0 and/or Q4_1 -> int4_wo (groups of 32,
    with a zero point when any is Q4_1: Q4_0's min is -8 * scale, exact in float16). The LM
    head (token_embd when tied) is kept quantized when it is Q8_0, Q4_0 or Q4_1; any other
    type is dequantized to the engine dtype.
    """
    from contract.quant import Quantization, QuantSpec

    types = _types(path)
    linear = {n: t for n, t in types.items() if n.endswith(_LINEAR_SUFFIXES)}
    other = sorted({t for t in linear.values() if t not in _BLOCK_TYPES})
    if other:
        name = next(n for n, t in linear.items() if t in other)
        raise BuildError(
            f"{path.name} holds linear weights as {', '.join(other)} (e.g. {name}); only Q8_0, "
            "Q4_0 and Q4_1 blocks become an engine directly",
            "requantize it with llama-quantize --pure to Q8_0 or Q4_0, or build from the "
            "floating-point checkpoint with --quant")
    kinds = {_BLOCK_TYPES[t][0] for t in linear.values()}
    if len(kinds) != 1:
        raise BuildError(f"{path.name} mixes int8 (Q8_0) and int4 (Q4_0/Q4_1) linear weights",
                         "requantize it with llama-quantize --pure")
    kind = kinds.pop()
    if _SCHEME_OF_KIND[kind] != scheme:
        raise BuildError(
            f"{path.name} holds {kind} blocks ({', '.join(sorted(set(linear.values())))}); "
            f"--quant {scheme} would quantize them again",
            f"use --quant {_SCHEME_OF_KIND[kind]} to keep llama.cpp's weights exactly, or "
            "--quant none for a floating-point engine")
    zero_point = any(_BLOCK_TYPES[t][1] for t in linear.values())
    head_name = "token_embd.weight" if tied else "output.weight"
    head_type = types.get(head_name, "")
    head = None
    if head_type in _BLOCK_TYPES:
        hk, hz = _BLOCK_TYPES[head_type]
        head = QuantSpec(hk, 32, hz)
    source = f"GGUF {'/'.join(sorted(set(linear.values())))}"
    if head is not None:
        source += f", {head_name} {head_type}"
    return Quantization(scheme, QuantSpec(kind, 32, zero_point), head, source)


def gguf_quant_getter(path: Path, cfg):  # -> Callable[[str, QuantSpec], QTensor]
    """HF tensor name -> that tensor's GGUF blocks as a QTensor, values unchanged.

    llama.cpp stores Llama q/k projections with their rows permuted for its RoPE; the
    rows are put back (whole rows of blocks move, so nothing is recomputed).
    """
    import numpy as np
    import torch
    from gguf import GGUFReader

    from runtime.quant import QTensor

    reader = GGUFReader(str(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    by_hf = {h: t for t in reader.tensors if (h := hf_name(t.name)) is not None}

    def get(name: str, spec):
        t = by_hf.get(name)
        if t is None and name == "lm_head.weight":
            t = by_hf.get("model.embed_tokens.weight")
        if t is None:
            raise BuildError(f"{path.name} has no tensor for {name}", "give a complete GGUF file")
        blocks = np.asarray(t.data).reshape(-1)
        n, k = int(t.shape[1]), int(t.shape[0])
        ttype = t.tensor_type.name
        kind, zp = _BLOCK_TYPES.get(ttype, (None, None))
        if kind != spec.kind or spec.group_size != 32 or (kind == "int4" and zp and not spec.zero_point):
            raise BuildError(f"{path.name}: {t.name} is {ttype}, not {spec.describe()}",
                             "requantize it with llama-quantize --pure")
        nb = k // 32
        size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[ttype]
        b = blocks.reshape(n, nb, size)
        scales = torch.from_numpy(b[:, :, 0:2].copy().view(np.float16).reshape(n, nb))
        mins = None
        if ttype == "Q8_0":
            q = torch.from_numpy(b[:, :, 2:].copy().view(np.int8).reshape(n, k))
        else:
            qs = b[:, :, 4:] if ttype == "Q4_1" else b[:, :, 2:]
            qs = torch.from_numpy(qs.copy()).reshape(n, nb, 1, 16)
            q = torch.cat((qs & 15, qs >> 4), dim=2).reshape(n, k)
            if ttype == "Q4_1":
                mins = torch.from_numpy(b[:, :, 2:4].copy().view(np.float16).reshape(n, nb))
            elif spec.zero_point:  # Q4_0 in a zero-point engine: min = -8 * scale, exact
                mins = scales * -8
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            perm = torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
            q, scales = q[perm], scales[perm]
            mins = None if mins is None else mins[perm]
        return QTensor(spec, q, scales, mins, 32)

    return get
