"""A CPU aoti engine holds two programs per rank, one graph compiled twice (contract/layout.py
DECODE_PROGRAM): the decode program, whose own loops run on one thread, takes the steps of up to
DECODE_PROGRAM_TOKENS tokens, the step program the others. The runner may switch between them
from one step to the next, so both must compute the same bits: the same logits and the same KV
entries for any step, whichever program runs it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from contract.layout import rank_package, rank_package_dir
from contract.manifest import read_manifest
from contract.profile import BuildProfile
from pipeline.build import build_engine
from pipeline.config import BuildConfig
from runtime.core.plan import ScheduledSeq
from runtime.executors.runner import ModelRunner, SeqState, prepare_inputs
from runtime.executors.torch import (
    DECODE_PROGRAM_TOKENS,
    SplitStep,
    allocate_kv_cache,
    make_step_fn,
    package_files,
)
from runtime.models.parallel import TPContext
from runtime.store.checkpoint import load_engine_model_config
from runtime.store.loader import load_shard

PROFILE = BuildProfile(max_batch_size=4, max_num_tokens=32, max_seq_len=64, tokens_per_block=4)
BLOCK = PROFILE.tokens_per_block


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = BuildConfig(model=str(tiny_models["llama_kv3"]), tp=1, backend="aoti", dtype="bfloat16",
                      target="cpu", profile=PROFILE, store=str(tmp_path_factory.mktemp("engines")))
    return build_engine(cfg).engine_dir


def _step_fn(engine: Path, weights: dict[str, torch.Tensor]) -> object:
    cfg = load_engine_model_config(engine)
    return make_step_fn("aoti", cfg, TPContext(), "bfloat16", weights, engine)


def _steps(vocab: int) -> dict[str, list[tuple[SeqState, ScheduledSeq]]]:
    """Steps of each kind, on disjoint blocks: one decode, a decode batch, a prompt longer than
    DECODE_PROGRAM_TOKENS, and a mixed step (decodes beside a prompt chunk)."""
    nxt = [1]

    def seq(i: int, done: int, new: int) -> tuple[SeqState, ScheduledSeq]:
        n = -(-(done + new) // BLOCK)
        table = list(range(nxt[0], nxt[0] + n))
        nxt[0] += n
        tokens = [(11 * i + 5 * j + 3) % vocab for j in range(done + new)]
        return SeqState(tokens, table), ScheduledSeq(i, done, new, [], sample=True)

    return {
        "decode": [seq(0, 9, 1)],
        "decode batch": [seq(i, 5 + 3 * i, 1) for i in range(4)],
        "prompt": [seq(0, 0, DECODE_PROGRAM_TOKENS + 4)],
        "mixed": [seq(0, 12, 1), seq(1, 7, 1), seq(2, 4, 9)],
    }


def test_both_programs_compute_the_same_logits_and_kv_entries(engine: Path) -> None:
    m = read_manifest(engine)
    listed = {f.path for f in m.files}
    assert {rank_package(0), rank_package(0, "decode")} <= listed
    files = package_files(listed, 0)
    assert any(f.startswith(rank_package_dir(0, "decode") + "/") for f in files), files
    assert any(f.startswith(rank_package_dir(0) + "/") for f in files), files
    cfg = load_engine_model_config(engine)
    shard = load_shard(engine / "rank0.safetensors", "cpu")
    split = _step_fn(engine, shard.weights)
    assert isinstance(split, SplitStep) and split.max_tokens == DECODE_PROGRAM_TOKENS
    for name, items in _steps(cfg.vocab_size).items():
        args, sampled = prepare_inputs(items, BLOCK)
        out = {}
        for program in ("step", "decode"):
            kv = allocate_kv_cache(cfg, 1, 64, BLOCK, "bfloat16")
            fn = getattr(split, program)
            with torch.inference_mode():
                logits = fn(*args, [kv[i, 0] for i in range(kv.shape[0])],
                            [kv[i, 1] for i in range(kv.shape[0])])
            out[program] = (logits[:len(sampled)].clone(), kv.clone())
        (la, kva), (lb, kvb) = out["step"], out["decode"]
        assert la.dtype == torch.float32 and la.shape == (len(sampled), cfg.vocab_size)
        assert la.abs().sum() > 0 and kva.abs().sum() > 0, name
        assert torch.equal(la, lb), f"{name}: logits differ by {(la - lb).abs().max()}"
        assert torch.equal(kva, kvb), f"{name}: KV entries differ"


def test_the_runner_takes_the_decode_program_for_steps_of_few_tokens(engine: Path) -> None:
    cfg = load_engine_model_config(engine)
    shard = load_shard(engine / "rank0.safetensors", "cpu")
    split = _step_fn(engine, shard.weights)
    assert isinstance(split, SplitStep)
    ran: list[tuple[str, int]] = []

    def counted(program: str) -> object:
        fn = getattr(split, program)
        return lambda *a: ran.append((program, a[0].shape[0])) or fn(*a)

    split.step, split.decode = counted("step"), counted("decode")
    runner = ModelRunner(split, allocate_kv_cache(cfg, 1, 64, BLOCK, "bfloat16"), BLOCK)
    used = set()
    for name, items in _steps(cfg.vocab_size).items():
        ran.clear()
        args, _ = prepare_inputs(items, BLOCK)
        with torch.inference_mode():
            runner.step_fn(*args, runner.k_caches, runner.v_caches)
        tokens = args[0].shape[0]
        want = "decode" if tokens <= DECODE_PROGRAM_TOKENS else "step"
        assert ran == [(want, tokens)], name
        used.add(want)
    assert used == {"decode", "step"}


def test_an_engine_without_a_decode_program_runs_its_one_program(engine: Path,
                                                                 tmp_path: Path) -> None:
    """Engines built before the decode program (and GPU engines) hold one program a rank."""
    old = tmp_path / "engine"
    shutil.copytree(engine, old)
    for p in old.rglob("*"):
        p.chmod(p.stat().st_mode | 0o200)  # the store makes engines read-only
    (old / rank_package(0, "decode")).unlink()
    shutil.rmtree(old / rank_package_dir(0, "decode"))
    names = [str(p.relative_to(old)) for p in old.rglob("*") if p.is_file()]
    assert not any(".decode." in n for n in package_files(names, 0))
    shard = load_shard(old / "rank0.safetensors", "cpu")
    fn = _step_fn(old, shard.weights)
    assert not isinstance(fn, SplitStep)
    cfg = load_engine_model_config(old)
    items = _steps(cfg.vocab_size)["decode"]
    args, sampled = prepare_inputs(items, BLOCK)
    kv = allocate_kv_cache(cfg, 1, 64, BLOCK, "bfloat16")
    with torch.inference_mode():
        logits = fn(*args, [kv[i, 0] for i in range(kv.shape[0])],
                    [kv[i, 1] for i in range(kv.shape[0])])
    assert logits[:len(sampled)].isfinite().all()
