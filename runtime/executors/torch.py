"""Model runners for torch engines (aoti and eager), from an engine or a raw checkpoint."""

from __future__ import annotations

import math
import mmap
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from contract.layout import (
    DECODE_PROGRAM,
    ENGINE_CONFIG,
    KERNELS_LIB,
    PROGRAMS,
    STEP_PROGRAM,
    rank_package,
    rank_package_dir,
    rank_shard,
)
from contract.quant import NONE, Quantization
from runtime import kernels
from runtime.executors.runner import ModelRunner, StepFn
from runtime.models.config import ModelConfig
from runtime.models.factory import (
    bind_weights,
    build_model,
    empty_kv_cache,
    kv_cache_shape,
    kv_cache_view,
    torch_dtype,
)
from runtime.models.parallel import TPContext
from runtime.models.sharding import bind_tied, shard_state_dict
from runtime.store.checkpoint import (
    load_engine_model_config,
    load_engine_quant,
    open_weights,
    read_model_config,
)
from runtime.store.files import EngineFiles
from runtime.store.loader import LoadedShard, load_shard

# Steps' token counts are padded to multiples of it (runtime/executors/runner.py): every distinct
# count is a new matrix shape, and oneDNN keeps a primitive per shape.
TOKEN_BUCKET = 16


def make_step_fn(
    backend: str, cfg: ModelConfig, tp: TPContext, dtype: str, weights: dict[str, torch.Tensor],
    engine_dir: Path | None = None, device: str = "cpu", quant: Quantization = NONE,
) -> StepFn:
    """The rank's step function with its weights bound (no copy of the weights)."""
    weights = bind_tied(cfg, weights)
    if backend == "eager":
        model = build_model(cfg, tp, torch_dtype(dtype), "meta", quant=quant)
        bind_weights(model, weights)
        return model
    if backend == "aoti":
        assert engine_dir is not None
        if (engine_dir / KERNELS_LIB).is_file():  # the ops the package calls, first
            kernels.load(engine_dir / KERNELS_LIB)
        step = load_step_fn(package_path(engine_dir, tp.rank), weights, device)
        decode = package_path(engine_dir, tp.rank, DECODE_PROGRAM)
        if not decode.exists():  # a GPU engine, or one built before it had a decode program
            return step
        return SplitStep(step, load_step_fn(decode, weights, device))
    raise ValueError(f"backend {backend!r} has no torch step function")


# torch's package loader (AOTIModelPackageLoader) opens an unpacked package directory in the
# torch this project is built and tested with (2.13); torch 2.11's only opens the zip, and
# fails on a directory. Before 2.13 the zip (rank{N}.pt2, also in every engine) is loaded.
LOADS_DIRECTORIES = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def package_files(names: Iterable[str], rank: int) -> list[str]:
    """The engine files a rank's compiled packages load from, each program's (contract/layout.py
    PROGRAMS; an engine without a decode program has none of its files): its unpacked
    directory (rank{N}.aoti/, engines built since it exists, where torch can load one) or
    else the zip (rank{N}.pt2)."""
    names = list(names)
    files: list[str] = []
    for program in PROGRAMS:
        prefix = rank_package_dir(rank, program) + "/"
        unpacked = [n for n in names if n.startswith(prefix)] if LOADS_DIRECTORIES else []
        zipped = rank_package(rank, program)
        files += unpacked or ([zipped] if program == STEP_PROGRAM or zipped in names else [])
    return files


def package_name(names: Iterable[str], rank: int, program: str = STEP_PROGRAM) -> str:
    """What a rank's program loads from (of package_files' `names`), as the gates report it:
    its unpacked directory, or else its zip."""
    unpacked = rank_package_dir(rank, program)
    return unpacked if any(n.startswith(unpacked + "/") for n in names) else rank_package(rank, program)


def package_path(engine_dir: Path, rank: int, program: str = STEP_PROGRAM) -> Path:
    unpacked = engine_dir / rank_package_dir(rank, program)
    return (unpacked if LOADS_DIRECTORIES and unpacked.is_dir()
            else engine_dir / rank_package(rank, program))


def allocate_kv_cache(
    cfg: ModelConfig, tp: int, num_blocks: int, block_size: int, dtype: str, device: str = "cpu"
) -> torch.Tensor:
    # Zeroed, so the null block and never-written slots hold finite values.
    shape = kv_cache_shape(cfg, tp, num_blocks, block_size)
    if device != "cpu":
        return empty_kv_cache(shape, torch_dtype(dtype), device)
    # On the host: fresh anonymous pages, which the kernel hands out zeroed when first
    # touched. torch.zeros would write every page now (0.5 s for 250 MB on a loaded host);
    # these fault in block by block as the cache fills. The tensor keeps the mapping alive.
    td = torch_dtype(dtype)
    nbytes = math.prod(shape) * td.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    return kv_cache_view(flat.view(td), shape)


def runner_from_checkpoint(
    hf_dir: Path, tp: TPContext, dtype: str, num_blocks: int, block_size: int,
    quant: Quantization = NONE,
) -> tuple[ModelRunner, ModelConfig]:
    """An eager runner straight from a Hugging Face checkpoint (sharded, and quantized with
    `quant`, in memory)."""
    cfg, _ = read_model_config(hf_dir)
    cfg.check_tp(tp.size)
    weights = shard_state_dict(open_weights(hf_dir), cfg, tp.size, tp.rank, torch_dtype(dtype), quant)
    step_fn = make_step_fn("eager", cfg, tp, dtype, weights, quant=quant)
    kv = allocate_kv_cache(cfg, tp.size, num_blocks, block_size, dtype)
    return ModelRunner(step_fn, kv, block_size), cfg


def engine_runner(
    backend: str, cfg: ModelConfig, tp: TPContext, dtype: str, shard: LoadedShard,
    package_dir: Path, kv: torch.Tensor, block_size: int, max_num_tokens: int | None,
    device: str = "cpu", quant: Quantization = NONE,
) -> ModelRunner:
    """The one builder of a runner over a built engine's rank: the serve gates (kernels),
    the build's golden run and the benches all run this, so the golden check runs what the
    server runs. `package_dir` holds the compiled package (the verified copies, when there
    is a manifest); `max_num_tokens` (the profile's, the compiled step's bound) caps the
    padding of a step's token count to TOKEN_BUCKET (None: no padding)."""
    step_fn = make_step_fn(backend, cfg, tp, dtype, shard.weights, package_dir, device, quant)
    runner = ModelRunner(step_fn, kv, block_size,
                         token_bucket=TOKEN_BUCKET if max_num_tokens else 1,
                         max_tokens=max_num_tokens)
    runner.keepalive = shard  # the step function's weights are views of its buffers
    return runner


def runner_from_engine(
    engine_dir: Path, backend: str, dtype: str, tp: TPContext, num_blocks: int, block_size: int,
    max_num_tokens: int | None, device: str = "cpu", files: EngineFiles | None = None,
) -> tuple[ModelRunner, ModelConfig]:
    """A runner over a built engine's rank shard (read and hashed by the loader), built as
    the server builds it (engine_runner); `max_num_tokens` is the engine profile's.

    With `files` (the engine's manifest, runtime/store/files.py) every file is checked
    before it is used and the package is loaded from its verified copy; without, only the
    build itself may call this, on the engine it has just written (no manifest yet).
    """
    src = engine_dir if files is None else files.get(ENGINE_CONFIG).parent
    cfg = load_engine_model_config(src)
    quant = load_engine_quant(src)
    if files is not None:
        files.require(rank_shard(tp.rank))
    shard = load_shard(engine_dir / rank_shard(tp.rank), device)
    if files is not None:
        files.check(rank_shard(tp.rank), shard.sha256)
        if backend == "aoti":
            for name in package_files(files.entries, tp.rank):
                files.get(name)
            src = files.dir
            files.get_listed((KERNELS_LIB,))
    kv = allocate_kv_cache(cfg, tp.size, num_blocks, block_size, dtype, device)
    runner = engine_runner(backend, cfg, tp, dtype, shard, src, kv, block_size, max_num_tokens,
                           device, quant)
    return runner, cfg


def device_index(device: str) -> int:
    """The package loader's device index: -1 on the CPU, N for a rank's "cuda:N" (the
    servers and the golden run name the GPU so), 0 for a bare "cuda"."""
    if not device.startswith("cuda"):
        return -1
    index = torch.device(device).index
    return 0 if index is None else index


class PackageStep:
    """A rank's compiled package with its weights bound, run through our `aotllm` ops:
    torch's own Python binding of the package holds the GIL for the whole step, and rank
    0's HTTP thread could then do nothing while the model computes."""

    def __init__(self, path: Path, weights: dict[str, torch.Tensor], device: str) -> None:
        ops = torch.ops.aotllm
        self.handle = ops.package_load(str(path), device_index(device))
        names = ops.package_constant_fqns(self.handle)
        missing = set(names) - set(weights)
        if missing:
            raise ValueError(f"{path.name}: the shard lacks constants {sorted(missing)[:5]}")
        self.weights = [weights[n] for n in names]  # user managed: kept alive here
        ops.package_load_constants(self.handle, names, self.weights)

    def __call__(self, *args: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        # The package's inputs, flattened as its call spec does: tensors, then each list.
        flat = [t for a in args for t in (a if isinstance(a, list) else (a,))]
        return torch.ops.aotllm.package_run(self.handle, flat)[0]


# Steps of at most this many tokens run the decode program (contract/layout.py DECODE_PROGRAM).
# Measured on 2 threads, AMD EPYC Zen 5 (AVX-512 BF16, no AMX), SmolLM2-135M bf16, one
# process, engines alternated over 10 rounds: a one-sequence decode step 6.56 -> 6.08 ms
# (per-round ratio 0.94), the program alone 6.11 -> 5.64; 16 sequences level (0.99). With
# every loop single-threaded a 128-token prompt took 1.07x as long, 512 tokens 1.05x: their
# rows are worth the team.
DECODE_PROGRAM_TOKENS = 16


class SplitStep:
    """A rank's two programs over the same weights: steps of up to DECODE_PROGRAM_TOKENS tokens
    run `decode` (the graph's own loops single-threaded), the others `step`. Both are one graph
    compiled twice; only OpenMP's pragmas differ, so a row's logits and KV entries are the same
    bits whichever runs it (tests/runtime/test_decode_program.py)."""

    def __init__(self, step: StepFn, decode: StepFn, max_tokens: int = DECODE_PROGRAM_TOKENS) -> None:
        self.step = step
        self.decode = decode
        self.max_tokens = max_tokens

    def __call__(self, *args: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        ids = args[0]
        assert isinstance(ids, torch.Tensor)
        fn = self.decode if ids.shape[0] <= self.max_tokens else self.step
        return fn(*args)


def load_step_fn(path: Path, weights: dict[str, torch.Tensor], device: str = "cpu") -> StepFn:
    """Load a compiled package and bind a rank's weights (kept by the caller: user managed)."""
    if kernels.available():
        return PackageStep(path, weights, device)
    pkg = torch._inductor.aoti_load_package(str(path), device_index=device_index(device))
    names = set(pkg.get_constant_fqns())
    missing = names - set(weights)
    if missing:
        raise ValueError(f"{path.name}: the shard lacks constants {sorted(missing)[:5]}")
    pkg.load_constants({k: v for k, v in weights.items() if k in names},
                       check_full_update=True, user_managed=True)
    return pkg
