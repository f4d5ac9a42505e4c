"""Issue 2's benchmark: our executor in process (no HTTP) against transformers `generate`.

Output tokens/s at 1, 4 and 16 concurrent requests (prompts of `prompt_len` tokens,
`new_tokens` greedy output tokens each, ignore_eos so the count is exact, fixed seed), in
bfloat16 and float32, with transformers at the same batch sizes, in one run:

    python -m bench.executor_throughput [--hf-dir DIR | --engine DIR] [--quick]

Uses the in-process API `runtime.executors.loop.LLMEngine`: from_checkpoint (TP=1, eager) or
from_engine_dir (a built TP=1 engine, aoti or eager); generate(prompts, params) runs the
in-flight batching loop to completion.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import md_table
from bench.hf_baseline import run_baseline
from bench.prompts import load_tokenizer, make_prompts

SEED = 1234


@dataclass(frozen=True)
class Row:
    dtype: str
    concurrency: int
    executor_tok_s: float
    transformers_tok_s: float

    @property
    def ratio(self) -> float:
        return self.executor_tok_s / self.transformers_tok_s


def make_engine(hf_dir: Path | None, engine_dir: Path | None, dtype: str, batch: int) -> Any:
    """A built TP=1 engine (aoti or eager, its own dtype), or an eager one from the checkpoint."""
    from contract.manifest import read_manifest
    from contract.profile import BuildProfile
    from runtime.core.scheduler import SchedulerConfig
    from runtime.executors.loop import LLMEngine
    from runtime.executors.torch import runner_from_checkpoint, runner_from_engine
    from runtime.models.parallel import TPContext
    from runtime.store.files import EngineFiles

    if engine_dir is not None:
        m = read_manifest(engine_dir)
        if m.tp != 1:
            raise SystemExit(f"{engine_dir} is a TP={m.tp} engine; this benchmark runs TP=1")
        p = m.profile
    else:
        assert hf_dir is not None
        p = BuildProfile(max_batch_size=max(batch, 1))
    blocks = p.max_batch_size * p.max_seq_len // p.tokens_per_block + 1
    if engine_dir is not None:
        runner, cfg = runner_from_engine(engine_dir, m.backend, m.dtype, TPContext(), blocks,
                                         p.tokens_per_block, p.max_num_tokens,
                                         files=EngineFiles(engine_dir, m))
    else:
        runner, cfg = runner_from_checkpoint(hf_dir, TPContext(), dtype, blocks, p.tokens_per_block)
    return LLMEngine(runner, SchedulerConfig(p.max_batch_size, p.max_num_tokens, p.tokens_per_block,
                                             blocks, p.max_seq_len, cfg.eos_token_ids))


def executor_tok_s(engine: Any, prompts: Sequence[list[int]], new_tokens: int) -> float:
    """Output tokens/s of one generate call over all prompts submitted at once."""
    from runtime.core.types import SamplingParams

    params = [
        SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, seed=SEED + i)
        for i in range(len(prompts))
    ]
    t = time.perf_counter()
    outs = engine.generate([list(p) for p in prompts], params)
    seconds = time.perf_counter() - t
    lengths = sorted({len(o) for o in outs})
    if lengths != [new_tokens]:
        raise RuntimeError(f"executor produced output lengths {lengths}, expected {new_tokens}")
    return len(prompts) * new_tokens / seconds


def run(
    hf_dir: Path,
    engine_dir: Path | None,
    dtypes: Sequence[str],
    levels: Sequence[int],
    prompt_len: int,
    new_tokens: int,
) -> list[Row]:
    tok = load_tokenizer(hf_dir)
    prompts = make_prompts(tok, max(levels), prompt_len, seed=SEED)
    rows: list[Row] = []
    for dtype in dtypes:
        engine = make_engine(None if engine_dir else hf_dir, engine_dir, dtype, max(levels))
        executor_tok_s(engine, prompts[:2], 4)  # warm allocator, thread pool and kernels
        ours = {c: executor_tok_s(engine, prompts[:c], new_tokens) for c in levels}
        del engine
        base = run_baseline(hf_dir, levels, (dtype,), prompt_len, new_tokens, seed=SEED)
        theirs = {b.batch: b.output_tok_s for b in base}
        rows += [Row(dtype, c, ours[c], theirs[c]) for c in levels]
        for r in rows[-len(levels) :]:
            print(f"  {r.dtype} c={r.concurrency}: ours {r.executor_tok_s:.1f} tok/s, "
                  f"transformers {r.transformers_tok_s:.1f} tok/s", flush=True)  # fmt: skip
    return rows


def format_table(rows: Sequence[Row]) -> str:
    header = ["dtype", "concurrent requests", "executor tok/s", "transformers generate tok/s",
              "ratio"]  # fmt: skip
    cells = ([r.dtype, r.concurrency, f"{r.executor_tok_s:.1f}", f"{r.transformers_tok_s:.1f}",
              f"{r.ratio:.2f}x"] for r in rows)  # fmt: skip
    return "\n".join(md_table(header, cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hf-dir", type=Path, default=None, help="default: python -m demo.model")
    ap.add_argument("--engine", type=Path, default=None, help="a built engine (its own dtype)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="levels 1 and 4, 16 new tokens")
    args = ap.parse_args(argv)
    from bench.common import demo_checkpoint

    try:
        hf_dir = args.hf_dir or demo_checkpoint()
    except RuntimeError as exc:
        print(f"executor_throughput: error: {exc}")
        return 2
    levels = [1, 4] if args.quick else args.levels
    new = 16 if args.quick else args.new_tokens
    if args.engine is not None and len(args.dtypes) > 1:
        print("executor_throughput: error: --engine has one dtype; pass the matching --dtypes X")
        return 2
    rows = run(hf_dir, args.engine, args.dtypes, levels, args.prompt_len, new)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
