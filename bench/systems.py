"""Which served systems a run measures, how each is launched, and its share of the time."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench import common
from bench.servers import ServerSpec, llama_spec, ours_spec, vllm_spec
from runtime.host import cpu_flags

SYSTEMS = ("ours-tp1", "ours-tp1-nowarmup", "ours-tp2", "llama-server", "vllm")
# `--quant` adds these (issue 12): our int8_wo / int4_wo engines at TP=1 and TP=2 built from
# llama.cpp's own Q8_0 / Q4_0 GGUFs (`make bench-peers` makes them from the bf16 GGUF), so
# both sides multiply by exactly the same weights, and llama-server on each file.
QUANT_SYSTEMS = ("ours-tp1-int8", "ours-tp1-int4", "ours-tp2-int8", "ours-tp2-int4",
                 "llama-server-q8_0", "llama-server-q4_0")
QUANT_OF = {"ours-tp1-int8": ("Q8_0", "int8_wo"), "ours-tp1-int4": ("Q4_0", "int4_wo"),
            "ours-tp2-int8": ("Q8_0", "int8_wo"), "ours-tp2-int4": ("Q4_0", "int4_wo"),
            "llama-server-q8_0": ("Q8_0", None), "llama-server-q4_0": ("Q4_0", None)}
QUANT_LEVELS = (1, 16)  # the concurrencies issue 12's targets name
# `--gemma3` adds these (issue 35): Gemma 3 270M, our TP=1 engine built from the wheels'
# Q4_K_M GGUF (dequantized exactly, then bfloat16) and llama-server on the same file.
GEMMA3_SYSTEMS = ("ours-gemma3-tp1", "llama-server-gemma3")
# `--spec` adds these (issue 36): the run's TP=1 and TP=2 engines served again with
# prompt-lookup speculation on (`--speculative ngram:4`), beside the same engines with it off.
SPEC_SYSTEMS = ("ours-tp1-ngram", "ours-tp2-ngram")
SPEC_ARGS = ("--speculative", "ngram:4")

# Seconds each system may take, launch to last request, so that `make bench` ends within
# 40 minutes on 2 cores even when one system is far slower than expected. vLLM gets the
# most: about two minutes of it is compiling before ready.
BUDGET_S = {
    "ours-tp1": 420.0,
    "ours-tp1-nowarmup": 240.0,
    "ours-tp2": 420.0,
    "llama-server": 300.0,
    "vllm": 600.0,
    **{name: 240.0 for name in QUANT_SYSTEMS},
    **{name: 240.0 for name in GEMMA3_SYSTEMS},
    **{name: 240.0 for name in SPEC_SYSTEMS},
}
QUICK_BUDGET_S = 240.0
TOTAL_BUDGET_S = 38 * 60.0  # the whole run, builds included; 2 minutes kept for the report
QUANT_BUDGET_S = 40 * 60.0  # what `--quant` adds: four engine builds and six systems
GEMMA3_BUDGET_S = 15 * 60.0  # what `--gemma3` adds: one engine build (a cache hit later), two systems
SPEC_BUDGET_S = 9 * 60.0  # what `--spec` adds: two systems on engines already built
# vLLM's compile cache for the run, emptied before its launch (see fresh_vllm_cache).
VLLM_CACHE = common.cache_dir() / "vllm-compile-cache"


@dataclass(frozen=True)
class Planned:
    name: str
    spec: ServerSpec | None  # None: skipped, for `why`
    why: str = ""
    sweep: bool = True  # ours-tp1-nowarmup only answers the warmup question
    levels: tuple[int, ...] | None = None  # a subset of the workload's levels (None: all)
    # The checkpoint whose tokenizer makes this system's prompts (None: the run's model).
    tokenizer_dir: Path | None = None


def tp_of(name: str) -> int:
    return 2 if name.startswith("ours-tp2") else 1


def build_engine(
    sh: Callable[[list[str]], str], source: Path, tp: int, quant: str | None = None
) -> Path:
    """`pipeline build` prints the engine directory last; a second build is a cache hit."""
    argv = [str(common.VENV_PYTHON), "-m", "pipeline", "build", str(source), "--tp", str(tp),
            "--dtype", "bfloat16", *(["--quant", quant] if quant else [])]  # fmt: skip
    return Path(sh(argv).strip().splitlines()[-1].strip())


def quant_gguf(hf_dir: Path, qtype: str) -> Path:
    """llama-quantize's `qtype` file of the checkpoint's bf16 GGUF (bench/peers.sh quant)."""
    bf16 = common.gguf_for(hf_dir)
    return bf16.with_name(bf16.name.replace("-bf16.gguf", f"-{qtype}.gguf"))


def plan_quant(hf_dir: Path, sh: Callable[[list[str]], str], skip: Sequence[str] = ()
               ) -> list[Planned]:
    """The quantized systems, ours built from the same GGUF files llama-server serves."""
    out: list[Planned] = []
    for name in QUANT_SYSTEMS:
        if name in skip:
            out.append(Planned(name, None, "skipped on the command line"))
            continue
        qtype, quant = QUANT_OF[name]
        gguf = quant_gguf(hf_dir, qtype)
        if not gguf.exists():
            why = f"{gguf.name} missing ({common.peer_status('quant')})"
            out.append(Planned(name, None, why))
        elif quant is None:
            if common.llama_server_bin().exists():
                # On CPUs with AMX-INT8 llama.cpp repacks Q8_0/Q4_0 for its AMX kernels, which
                # died with SIGILL at the first batch on the Xeon of stops 27-28; the blocks as
                # stored run (its AVX-512 dot products), so the peer is measured that way there.
                repack = "amx_int8" not in cpu_flags()
                spec = replace(llama_spec(gguf, common.free_port(), repack=repack), name=name)
                out.append(Planned(name, spec, levels=QUANT_LEVELS))
            else:
                out.append(Planned(name, None, f"not installed ({common.peer_status(common.llama_peer())})"))
        else:
            try:
                engine = build_engine(sh, gguf, tp_of(name), quant)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                out.append(Planned(name, None, f"engine build failed: {exc}"))
                continue
            spec = ours_spec(engine, common.free_port(), tp_of(name), "auto", name)
            out.append(Planned(name, spec, levels=QUANT_LEVELS))
    return out


def plan_gemma3(sh: Callable[[list[str]], str], skip: Sequence[str] = ()) -> list[Planned]:
    """Gemma 3 270M beside llama-server on the same GGUF, c=1 and c=16, prompts made with
    Gemma's own tokenizer (the build's dequantized checkpoint holds it)."""
    from pipeline.resolve import resolve

    try:
        gguf = common.gemma3_gguf()
        hf_dir = resolve(str(gguf)).local_dir  # the build's own dequantization (cached)
    except (RuntimeError, OSError, ValueError) as exc:
        return [Planned(name, None, f"no Gemma 3 GGUF: {exc}") for name in GEMMA3_SYSTEMS]
    out: list[Planned] = []
    for name in GEMMA3_SYSTEMS:
        if name in skip:
            out.append(Planned(name, None, "skipped on the command line"))
        elif name.startswith("llama-server"):
            if common.llama_server_bin().exists():
                spec = replace(llama_spec(gguf, common.free_port()), name=name)
                out.append(Planned(name, spec, levels=QUANT_LEVELS, tokenizer_dir=hf_dir))
            else:
                out.append(Planned(name, None, f"not installed ({common.peer_status(common.llama_peer())})"))
        else:
            try:
                engine = build_engine(sh, gguf, tp_of(name))
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                out.append(Planned(name, None, f"engine build failed: {exc}"))
                continue
            spec = ours_spec(engine, common.free_port(), tp_of(name), "auto", name)
            out.append(Planned(name, spec, levels=QUANT_LEVELS, tokenizer_dir=hf_dir))
    return out


def plan_spec(planned: Sequence[Planned], skip: Sequence[str] = ()) -> list[Planned]:
    """Speculation on, each system on the engine its plain twin (ours-tp1, ours-tp2) serves,
    at c=1 and c=16; the report puts each beside its twin."""
    twins = {p.name: p for p in planned}
    out: list[Planned] = []
    for name in SPEC_SYSTEMS:
        twin = twins.get(name.removesuffix("-ngram"))
        if name in skip:
            out.append(Planned(name, None, "skipped on the command line"))
        elif twin is None or twin.spec is None:
            out.append(Planned(name, None, f"{name.removesuffix('-ngram')} is not measured"))
        else:
            engine = Path(twin.spec.argv[twin.spec.argv.index("--engine") + 1])
            spec = ours_spec(engine, common.free_port(), tp_of(name), "auto", name)
            spec = replace(spec, argv=(*spec.argv, *SPEC_ARGS))
            out.append(Planned(name, spec, levels=QUANT_LEVELS))
    return out


def plan(
    hf_dir: Path,
    skip: Sequence[str],
    given: dict[int, Path | None],
    sh: Callable[[list[str]], str],
) -> list[Planned]:
    """One entry per system in run order; engines of ours are built (or reused) first."""
    engines: dict[int, Path | str] = {}
    for tp in sorted({tp_of(n) for n in SYSTEMS if n.startswith("ours") and n not in skip}):
        try:
            engines[tp] = given.get(tp) or build_engine(sh, hf_dir, tp)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
            engines[tp] = f"engine build failed: {exc}"
    out: list[Planned] = []
    for name in SYSTEMS:
        if name in skip:
            out.append(Planned(name, None, "skipped on the command line"))
        elif name.startswith("ours"):
            eng = engines[tp_of(name)]
            if isinstance(eng, str):
                out.append(Planned(name, None, eng))
                continue
            warm = "none" if name.endswith("nowarmup") else "auto"
            spec = ours_spec(eng, common.free_port(), tp_of(name), warm, name)
            out.append(Planned(name, spec, sweep=warm == "auto"))
        elif name == "llama-server":
            gguf = common.gguf_for(hf_dir)
            if common.llama_server_bin().exists() and gguf.exists():
                out.append(Planned(name, llama_spec(gguf, common.free_port())))
            else:
                why = f"{common.peer_status(common.llama_peer())}; gguf: {common.peer_status('gguf')}"
                out.append(Planned(name, None, f"not installed ({why})"))
        elif common.peer_status("vllm").startswith("ok") and common.vllm_python().exists():
            spec = vllm_spec(hf_dir, common.free_port(), VLLM_CACHE)
            out.append(Planned(name, spec))
        else:
            out.append(Planned(name, None, f"not installed ({common.peer_status('vllm')})"))
    return out


def engine_files(planned: Sequence[Planned]) -> list[Path]:
    """The files our TP=1 server reads at load (weights and compiled kernels)."""
    for p in planned:
        if p.spec is not None and p.name == "ours-tp1":
            engine = Path(p.spec.argv[p.spec.argv.index("--engine") + 1])
            return sorted(f for f in engine.iterdir() if f.suffix in (".safetensors", ".pt2"))
    return []


def fresh_vllm_cache() -> None:
    """Empty the run's vLLM cache so its launch compiles, as on a fresh machine."""
    shutil.rmtree(VLLM_CACHE, ignore_errors=True)
    VLLM_CACHE.mkdir(parents=True)
