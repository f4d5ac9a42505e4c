"""The names of the files in an engine directory (docs/design.md §3)."""

from __future__ import annotations

MANIFEST_NAME = "manifest.json"
# Ours for aoti/eager engines: {"model": ModelConfig, "hf_config": ...}. A TensorRT-LLM engine
# keeps TensorRT-LLM's own EngineConfig under this name and ours in MODEL_CONFIG_TRTLLM.
ENGINE_CONFIG = "config.json"
TRTLLM_CONFIG = ENGINE_CONFIG
MODEL_CONFIG_TRTLLM = "model_config.json"
GENERATION_CONFIG = "generation_config.json"
# Tokenizer and chat template, copied from the checkpoint when present.
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


# The golden run's log-probabilities over the fidelity text, left in the staging directory
# for the build to compare with transformers (pipeline/fidelity.py), never in an engine.
FIDELITY_FILE = ".fidelity.pt"

# Our compiled CPU kernels (aoti engines on CPU), loaded before any rank's package.
KERNELS_LIB = "kernels.so"

# How the linear weights of the decoder layers are stored in the rank shards: "rows" is
# row-major [out, in] as in the checkpoint; "panels16" is panels of 16 output columns,
# K-major (runtime/models/panels.py), the layout our outer-product kernel reads without a
# transpose per call (runtime/kernels/panel_linear.cpp). Chosen at build time for the
# target, like TensorRT's tactics, and recorded in the manifest. "panels16q" is panels16
# with the quantized linears of the decoder layers in pair panels as well (whole panels,
# runs and groups of 32: runtime/models/panels.py pack_qpanels), the layout the integer
# kernel of AVX2 targets reads (runtime/kernels/qpanel_linear.cpp); quantized weights of a
# "panels16" engine stay row-major (contract/quant.py layout 1). "panels16qh" (what builds
# write now) is "panels16q" with a quantized LM head in pair panels too (the tied embedding
# has its own row-major copy in the shard); "panels16q" engines, head row-major, still load.
# "rowsqh" is "rows" for float weights with the quantized linears and LM head in pair panels:
# what AVX512-BF16/AMX targets read (float GEMMs there run `vdpbf16ps` and oneDNN on
# row-major weights, the pair panels `vpdpwssd`: runtime/kernels/qpanel_vnni.h).
# "pairs16" is for bf16 engines on AVX512-BF16 and AMX targets: the float linears and LM head
# in pair panels (16 columns, each column's weights interleaved by pairs of k), whose runs of
# 32 k are, byte for byte, AMX's B tiles: runtime/kernels/pair_linear.cpp multiplies them as
# stored (oneDNN on row-major weights repacked them for its tiles in every call: twice the
# memory's time). Without AMX its `vdpbf16ps` passes (a broadcast pair of x against 16
# columns) beat row-major dot products and oneDNN too: SmolLM2's 30 layers, 1 thread, AMD
# EPYC (Zen 4, AVX512-BF16): 1 row 12.2 ms both, 4 rows 22.5 -> 14.8, 16 rows 45.9 -> 28.1,
# 64 rows 91.8 -> 77.3; its LM head (float32 logits) 16 rows 10.7 (oneDNN, bf16 out) -> 7.3.
WEIGHT_LAYOUTS = ("rows", "panels16", "panels16q", "panels16qh", "rowsqh", "pairs16")
FLOAT_PANEL_LAYOUTS = ("panels16", "panels16q", "panels16qh")  # float linears in panels
FLOAT_PAIR_LAYOUTS = ("pairs16",)  # float linears (and LM head) in pair panels
QPANEL_LAYOUTS = ("panels16q", "panels16qh", "rowsqh")  # quantized linears in pair panels
QHEAD_LAYOUTS = ("panels16qh", "rowsqh")  # a quantized LM head in pair panels too
PANEL_COLUMNS = 16
# CPU ISA levels without a native bf16 dot product: there the panel kernel beats the
# row-major paths (on avx512_bf16/amx targets vdpbf16ps and oneDNN keep row-major weights).
_PANEL_ISAS = ("avx2", "avx512")
# Where bf16 engines take pair panels ("pairs16"): AMX tiles, or vdpbf16ps passes.
_PAIR_ISAS = ("avx512_bf16", "amx")
# Where quantized 16-bit models take pair panels: AVX2's integer kernel, AVX-512's VNNI one
# (`vpmaddwd` + `vpaddd` on AVX-512 targets without VNNI). The avx512 level had none: its
# quantized linears stayed row-major and dequantized every run per call to float32
# (quant_linear.cpp), and its served Q8_0 engine ran at 0.40x llama-server at c=1 (AVX-512
# forced on an Intel Xeon with AMX, 31 ms a token against 6 at the avx2 level).
_QPANEL_LAYOUT = {"avx2": "panels16qh", "avx512": "panels16qh", "avx512_bf16": "rowsqh",
                  "amx": "rowsqh"}


def weight_layout_for(backend: str, device: str, isa: str | None, quantized: bool = False,
                      dtype: str | None = None) -> str:
    """The layout a build writes for aoti engines on CPU targets: float linears in panels
    where the panel kernel wins (_PANEL_ISAS), in pair panels for bf16 engines (`dtype`) on
    targets with a bf16 dot product (_PAIR_ISAS), and when `quantized` (a quantized engine of
    16-bit activations) the quantized linears in pair panels where an integer kernel reads
    them (_QPANEL_LAYOUT)."""
    if backend != "aoti" or device != "cpu":
        return "rows"
    if quantized and isa in _QPANEL_LAYOUT:
        return _QPANEL_LAYOUT[isa]
    if not quantized and isa in _PAIR_ISAS and dtype == "bfloat16":
        return "pairs16"
    return "panels16" if isa in _PANEL_ISAS else "rows"


def rank_shard(rank: int) -> str:
    """A rank's weights (aoti, eager)."""
    return f"rank{rank}.safetensors"


# A rank's programs (aoti). STEP_PROGRAM runs any step. On a CPU target the build also
# compiles the same graph as DECODE_PROGRAM, its generated loops (norms, RoPE, KV writes,
# SwiGLU, residual adds) without OpenMP: a step of a few tokens has a row or two for each
# of those loops, and the team's wake-up and barriers (five regions a layer) cost more than
# the rows (runtime/executors/torch.py runs it for steps of up to DECODE_PROGRAM_TOKENS).
STEP_PROGRAM = ""
DECODE_PROGRAM = "decode"
PROGRAMS = (STEP_PROGRAM, DECODE_PROGRAM)


def _program(rank: int, program: str) -> str:
    if program not in PROGRAMS:
        raise ValueError(f"unknown program {program!r}: one of {PROGRAMS}")
    return f"rank{rank}.{program}" if program else f"rank{rank}"


def rank_package(rank: int, program: str = STEP_PROGRAM) -> str:
    """A rank's AOTInductor package (aoti), as torch writes it (a zip)."""
    return f"{_program(rank, program)}.pt2"


def rank_package_dir(rank: int, program: str = STEP_PROGRAM) -> str:
    """Rank N's AOTInductor package extracted at build time (aoti): the compiled library
    and its metadata, loaded as they are (no zip to unpack at every start)."""
    return f"{_program(rank, program)}.aoti"


def rank_trt_engine(rank: int) -> str:
    """A rank's TensorRT engine (trtllm)."""
    return f"rank{rank}.engine"
