"""Ahead-of-time compile of the step function: torch.export, then AOTInductor.

Weights are left out of the package (`package_constants_in_so=False`) and bound at load
with `load_constants(..., user_managed=True)`, so loading weights and loading kernels
are separate gates at serve time. Every rank's program is the same (local shapes are
equal and the rank-specific vocabulary offset is a bound parameter), so it is compiled
once and written as each rank's `rank{N}.pt2`, and unpacked as `rank{N}.aoti/`, which is what
the server loads (pipeline/compile/extract.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.export import Dim

from contract.errors import EXIT_FAILURE, BuildError
from contract.layout import (
    DECODE_PROGRAM,
    KERNELS_LIB,
    STEP_PROGRAM,
    rank_package,
    rank_package_dir,
)
from contract.profile import BuildProfile
from contract.quant import NONE, Quantization
from contract.target import Target
from pipeline.compile.extract import extract_package
from pipeline.compile.kernels import MARCH, build_kernels
from pipeline.progress import Progress
from runtime import kernels
from runtime.core.plan import ScheduledSeq
from runtime.executors.runner import SeqState, prepare_inputs
from runtime.models.config import ModelConfig
from runtime.models.factory import build_model, empty_kv_cache, kv_cache_shape, torch_dtype
from runtime.models.parallel import TPContext

# One mixed step whose every dynamic size differs from the others and is >= 2 (export
# specialises sizes 0 and 1, and may merge dimensions whose example sizes are equal):
# tokens 15, decode rows 4 x 3 blocks, prefill rows 2 x chunk 7 x 5 blocks, 6 logit rows.
_DECODES = 4  # each with 2 full blocks + 1 token: 3 blocks
_PREFILLS = ((0, 7), (4, 4))  # (context blocks already computed, new tokens)


def example_inputs(profile: BuildProfile, vocab: int) -> tuple[torch.Tensor, ...]:
    bs = profile.tokens_per_block
    items: list[tuple[SeqState, ScheduledSeq]] = []
    next_block = 1

    def add(done: int, new: int) -> None:
        nonlocal next_block
        n = -(-(done + new) // bs)
        table = list(range(next_block, next_block + n))
        next_block += n
        i = len(items)
        tokens = [(7 * i + j) % vocab for j in range(done + new)]
        items.append((SeqState(tokens, table), ScheduledSeq(i, done, new, [], sample=True)))

    for _ in range(_DECODES):
        add(2 * bs, 1)
    for ctx_blocks, new in _PREFILLS:
        add(ctx_blocks * bs, new)
    args, _ = prepare_inputs(items, bs)
    return args


def dynamic_shapes(profile: BuildProfile, layers: int) -> tuple[object, ...]:
    # Ranges cover the profile (the scheduler never exceeds it) and the example above.
    b, m, t = profile.max_batch_size, profile.max_blocks_per_seq, profile.max_num_tokens
    tokens = Dim("tokens", min=1, max=max(t, 16))
    kv_blocks = Dim("kv_blocks", min=2, max=1 << 24)
    dec = Dim("decode_seqs", min=1, max=max(b, _DECODES))
    pf = Dim("prefill_seqs", min=1, max=max(b, len(_PREFILLS)))
    return (
        {0: tokens}, {0: tokens}, {0: tokens}, {0: tokens},
        {0: dec}, {0: dec, 1: Dim("decode_blocks", min=1, max=max(m, 3))}, {0: dec},
        {0: pf, 1: Dim("prefill_chunk", min=1, max=max(t, 7))},
        {0: pf, 1: Dim("prefill_blocks", min=1, max=max(m, 5))},
        # Up to a whole step's tokens: prompt log-probabilities (echo) want a row per token.
        {0: Dim("logit_rows", min=1, max=max(t, 6))},
        [{0: kv_blocks}] * layers,
        [{0: kv_blocks}] * layers,
    )


def _target_configs(target: Target) -> dict[str, object]:
    """Inductor settings for a CPU target: its -march, not the build host's (-march=native),
    so an engine recorded for avx2 holds no AVX-512 instruction. The vector width of the
    generated loops follows ATEN_CPU_CAPABILITY, which AOTLLM_CPU_ISA sets (runtime/host.py)."""
    if target.device != "cpu" or target.arch not in ("x86_64", "AMD64"):
        return {}
    return {"cpp.march": MARCH[target.isa or "baseline"]}


def inductor_configs(target: Target, program: str, use_kernels: bool) -> dict[str, object]:
    return {
        "aot_inductor.package_constants_in_so": False,
        # Inductor otherwise inlines tiny parameters as literals: the vocabulary offset
        # would be rank 0's in every rank's program.
        "always_keep_tensor_constants": True,
        **_target_configs(target),
        # our ops called through their C entry points, not the proxy executor
        "aot_inductor.custom_ops_to_c_shims": kernels.c_shims() if use_kernels else {},
        # the decode program: the generated loops without OpenMP (contract/layout.py)
        **({"cpp.threads": 1} if program == DECODE_PROGRAM else {}),
    }


def compile_program(ep: torch.export.ExportedProgram, path: Path, target: Target, program: str,
                    use_kernels: bool) -> None:
    torch._inductor.aoti_compile_and_package(
        ep, package_path=str(path), inductor_configs=inductor_configs(target, program, use_kernels))


@contextlib.contextmanager
def _compile_in_child(ep: torch.export.ExportedProgram, engine_dir: Path, target: Target,
                      tp: int, progress: Progress) -> Iterator[Callable[[], None]]:
    """Start compiling the decode program in a child process (this module's main); yields
    the function that waits for it and raises a BuildError with the child's last words if
    it failed. The child is killed if the build stops first."""
    with tempfile.TemporaryDirectory(prefix="aotllm-decode-") as tmp:
        saved = Path(tmp) / "program.pt2"
        torch.export.save(ep, saved)
        log_path = Path(tmp) / "log"
        argv = [sys.executable, "-m", "pipeline.compile.aoti", str(saved),
                str(engine_dir / rank_package(0, DECODE_PROGRAM)), json.dumps(target.to_dict()),
                str(tp), str(engine_dir / KERNELS_LIB)]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

        def wait() -> None:
            with progress.stage("compile decode program (second process)"):
                rc = proc.wait()
            if rc != 0:
                words = log_path.read_text(errors="replace").strip().splitlines()
                raise BuildError(
                    f"compiling the decode program failed (exit {rc}): "
                    f"{words[-1] if words else 'no output'}",
                    "check the C++ compiler and the disk, or build with --backend eager",
                    exit_code=EXIT_FAILURE)

        try:
            yield wait
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _child(argv: list[str]) -> None:
    """The decode program's compile, in the process _compile_in_child starts."""
    saved, out, target, tp, lib = argv
    kernels.load(Path(lib))
    with _trace_group(int(tp)):
        ep = torch.export.load(saved)
        compile_program(ep, Path(out), Target.from_dict(json.loads(target)), DECODE_PROGRAM,
                        use_kernels=True)


@contextlib.contextmanager
def _trace_group(tp: int) -> Iterator[None]:
    """A fake world group of size tp, so collectives trace with the serve-time group name."""
    if tp == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("compile_engine needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compile_engine(
    engine_dir: Path, cfg: ModelConfig, tp: int, dtype: str, profile: BuildProfile,
    target: Target, progress: Progress | None = None, quant: Quantization = NONE,
    weight_layout: str = "rows",
) -> list[Path]:
    """Write engine_dir/rank{N}.pt2 for every rank (and on a CPU target kernels.so and each
    rank's decode program, rank{N}.decode.pt2: contract/layout.py DECODE_PROGRAM)."""
    progress = progress or Progress.silent()
    device = "cuda" if target.device == "cuda" else "cpu"
    td = torch_dtype(dtype)
    use_kernels = device == "cpu"
    if use_kernels:  # our kernels, compiled for the target ISA, go into the engine
        lib = build_kernels(target, progress)
        shutil.copyfile(lib, engine_dir / KERNELS_LIB)
        kernels.load(engine_dir / KERNELS_LIB)
    with _trace_group(tp):
        model = build_model(cfg, TPContext(0, tp), td, device, use_kernels, quant, weight_layout)
        # RoPE's inverse frequencies are made on the host whatever the device
        # (runtime/models/rope.py): on a GPU they would enter the program as CPU tensors.
        model = model.to(device)
        args = tuple(a.to(device) for a in example_inputs(profile, cfg.vocab_size))
        # The runner's cache layout (head-major strides): the program is compiled for them.
        kv = empty_kv_cache(kv_cache_shape(cfg, tp, 32, profile.tokens_per_block), td, device)
        k_caches = [kv[i, 0] for i in range(cfg.num_hidden_layers)]
        v_caches = [kv[i, 1] for i in range(cfg.num_hidden_layers)]
        with progress.stage("export"), torch.inference_mode(False), torch.no_grad():
            ep = torch.export.export(
                model, (*args, k_caches, v_caches),
                dynamic_shapes=dynamic_shapes(profile, cfg.num_hidden_layers), strict=False,
            )
        del model
        programs = [STEP_PROGRAM]
        if device == "cpu":  # a step of a few tokens runs its own loops on one thread
            programs.append(DECODE_PROGRAM)
        # The decode program compiles in a second process while this one compiles the step
        # program: each is ~25 s of Inductor's Python and ~11 s of g++ for SmolLM2, and a
        # build host has the cores (the second program would otherwise double the compile).
        with contextlib.ExitStack() as stack:
            second = (stack.enter_context(_compile_in_child(ep, engine_dir, target, tp, progress))
                      if DECODE_PROGRAM in programs else None)
            with progress.stage("compile step program"):
                compile_program(ep, engine_dir / rank_package(0), target, STEP_PROGRAM,
                                use_kernels)
            if second is not None:
                second()
    paths = []
    for program in programs:
        first = engine_dir / rank_package(0, program)
        for rank in range(tp):
            dst = engine_dir / rank_package(rank, program)
            if rank:
                shutil.copyfile(first, dst)
            paths.append(dst)
            # unpacked once here, not by the loader at every start
            extract_package(first, engine_dir / rank_package_dir(rank, program))
    return paths


if __name__ == "__main__":
    _child(sys.argv[1:])
